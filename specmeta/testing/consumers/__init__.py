"""Reference consumers: torch models of what attention kernels compute from the metadata, used to
prove end to end that specmeta's metadata means what the spec says."""
