"""More than one machine: the state replicas share (`state`), and the routing of a call to the replica
that holds what it names."""
