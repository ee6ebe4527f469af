"""Planning a deployment without running it: a machine profile (`profile`), the cost arithmetic of afd's steps
(`costs`), a discrete-event simulation of afd's own scheduling rules (`simulator`), the closed-form A:F ratio
(`ratio`) and the search over deployments of N GPUs (`plan`). Between `afd.bench` (whose workloads and reports it
reuses) and `afd.cli`."""
