"""The Ray Serve application: ingress, router actor and LoRA replicas. The only package that imports ray."""
