"""Pure-torch reference kernels: the definition every other implementation is probed against."""
