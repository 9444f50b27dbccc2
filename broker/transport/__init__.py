"""The node-to-node protocol, both ends of it: the wire format of a batch (wire), how requests and
answers are signed (signing), sending a batch and checking its answer (sending), taking a batch in
and answering it (receiving), and what a node tells a peer about itself (describe).

Nothing here speaks HTTP as a server: api.routes.transport hands requests to `receiving` and
`describe`, and the relay (broker.relay) sends through `sending`.
"""
