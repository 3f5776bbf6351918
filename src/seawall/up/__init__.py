"""`seawall up`: a whole local fleet (replicas, gateway, optional traffic) in one command."""
