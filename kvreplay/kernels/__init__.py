"""The bottom floor: compiled CPU kernels (C++ sources under csrc/, built on first use), 2 MiB
pages for large CPU buffers, and the environment switches that turn kernel paths on and off.
Nothing here imports the rest of kvreplay."""
