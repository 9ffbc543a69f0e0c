"""kvrelay.router"""

# The router's exit status when its HTTP port or control address is taken (sysexits'
# EX_TEMPFAIL: try again). ``kvrelay up`` picks free ports for it, and another process can take
# one between the pick and the router's bind: the launcher then picks others and starts again.
EXIT_ADDRESS_IN_USE = 75
