"""``kvrelay sim``: a discrete-event simulation of a kvrelay cluster on a virtual clock.

It runs the router's real placement (``Registry.place`` over ``CacheIndex.match``) and the
autoscaler's real policy (``Policy.decide``) over simulated instances whose costs come from a
measured ``Profile``. See DESIGN.md ("Simulator") for the model and its limits.

``trace`` (trace files) is standard-library only; ``measure`` imports torch when called.
"""
