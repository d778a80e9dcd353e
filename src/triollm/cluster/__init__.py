"""Replicas behind Envoy on one machine: the config generator and the supervisor.

``envoy.py`` writes the Envoy configuration a user can copy (deploy/envoy/envoy.yaml
is its output for two replicas); ``supervise.py`` starts N ``triollm serve``
processes on distinct loopback addresses plus Envoy in front of them, restarts a
replica that dies (as a Kubernetes Deployment would) and drains them all on SIGTERM.
docs/scale-out.md explains what each part of the config is for.
"""
