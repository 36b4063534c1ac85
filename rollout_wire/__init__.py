"""The wire contract between trainers and workers: queue and task names, Redis keys, the batch
request, episode rows, report fields and the codec of everything stored or streamed in Redis.

Pure and light (orjson only): the trainer's side imports it without Celery workers, backends or
Kubernetes, and so does every worker process.
"""
