"""What runs every step: the network and colocated executors, the copy engine they share, copy lanes,
bind-time view checks, quantization kernels and timing. Internal.
"""
