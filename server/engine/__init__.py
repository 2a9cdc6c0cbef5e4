"""The engine: the scheduler, the step loop and its policies (speculation, grammar masks, prefix
lookup). It talks to the stages only through the ring interface (server.ring) and knows nothing
of HTTP."""
