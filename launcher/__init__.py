"""jitrun: torchrun with just-in-time checkpoint recovery."""
