"""Network plumbing shared by the wire protocols (server mode, P2P, the controller client).

    framing.py   exact socket reads and the protocol errors of both wire protocols
    tls.py       cluster TLS: contexts, self-signed test certificates, refusal reasons
    breaker.py   the circuit breaker of the remote tiers (Redis, Mooncake, peers)
"""
