"""Torch reference ops: the twins every other backend is held to, and the paths on devices without one."""
