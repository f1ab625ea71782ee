"""Where each request goes: time estimates, routing policies, the conductor and a trace-driven simulator.

The router imports only numpy and ``kvstore`` (never torch, the engine or the services), so the live
gateway and the simulator run the very same decision code.
"""
