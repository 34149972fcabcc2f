"""Deployment on Flower: the programs' runs with their clients on other
machines (the `deploy` extra: flwr).

`codec` (pytrees as Flower array records, checked on arrival against what
was dispatched), `server` (the deployed round: the engine's keys, the
algorithm's dispatch and aggregate, sums in the simulation's order),
`node` (a node's clients' updates, their state kept there),
`stitch_server` and `stitch_node` (a FedStitch run's participants on
their nodes), `serverapp` and `clientapp` (the Flower ServerApp and
ClientApp),
`federation`, `credentials` and
`watchdog` (a SuperLink and SuperNodes on this machine, TLS and node
keys, nothing outliving the program), `launch` (one run) and `adapter`
(every use of the run pipeline). The layer sits above the
algorithms and local training and below the programs.
"""
