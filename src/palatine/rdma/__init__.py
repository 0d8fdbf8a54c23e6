"""One-sided buffers (Monarch's ``RDMABuffer``): an owner registers bytes, holders of
the buffer anywhere in the job read and write them, and the owner's actors take no
part. See docs/rdma.md."""

from palatine.rdma.buffer import RDMABuffer

__all__ = ["RDMABuffer"]
