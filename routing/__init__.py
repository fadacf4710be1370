"""The router's side of adapter placement, free of Ray: the placement policy, and the typed values that cross
between the router, its state actor and the replicas (hints one way, replica statistics the other)."""
