"""Jobs: where the hosts of a mesh come from. `hostmesh` is the calling machine
(`this_host()`), with an embedded system and proc meshes of real OS processes.
"""
