"""The synthetic models' kit, shared by the synthetic and Fisher studies: sweep
settings and records (:mod:`studies.toy.setup`), the flows (:mod:`studies.toy.flow`) and
the bandwidth grid (:mod:`studies.toy.grid`)."""
