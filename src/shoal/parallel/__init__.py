"""Running on several devices: data-parallel engine replicas (`data_parallel`)."""
