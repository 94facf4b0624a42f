"""Testing support that ships with the package: torch models of the attention kernels that read
specmeta's metadata (:mod:`.consumers`), one interface over those models and the real kernels
(:mod:`.attention`), used by the tests, ``specmeta check`` and the examples."""
