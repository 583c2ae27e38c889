"""Fleet simulator (``tokenmill sim``): many replicas behind the router's own policies.

Modules: ``profiles`` (replica performance profiles and presets), ``replica`` (one replica's
batching over a real RadixCache), ``fleet`` (the event loop, sessions, router, scaling),
``config`` (run configuration), ``metrics`` (statistics, files, plots), ``static`` (static
hashing analysis), ``calibrate`` (profile from a running server), ``cli``. See docs/simulator.md.
"""
