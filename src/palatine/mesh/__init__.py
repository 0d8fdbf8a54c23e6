"""Meshes of actors: an `ActorMesh` names one actor on each proc of a shape, and its
endpoints call, broadcast, stream or choose across them; values come back as a
`ValueMesh` in rank order. `mypy_plugin` lets mypy check those calls against the
endpoints' own signatures.
"""
