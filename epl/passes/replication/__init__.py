"""The replicate pass's parts (epl/passes/replication/replicate.py runs them in order):
inputs (each unit's batch), mirrors (each replica's variables), copies (forward,
backward and update copies), merge
(fetched values), split_connection (replicas around epl.split TaskGraphs) and
result (the values they hand each other)."""
