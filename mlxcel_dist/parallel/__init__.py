"""Parallelism inside a job: collectives, a rank joining its group, tensor-parallel
sharding and its partition, pipeline stages."""
