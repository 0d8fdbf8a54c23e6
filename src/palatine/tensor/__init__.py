"""The single-controller engine: one client drives tensor workers through a controller.

`client` builds the program (remote functions, fetches, collectives) and sends it;
`controller` keeps its history, fans commands out to the workers and watches their
progress; `worker` runs the commands, one thread per stream, with torch.distributed
for collectives. Their messages are in `palatine.protocol`.
"""
