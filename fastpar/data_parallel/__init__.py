"""Data parallelism: bucketed gradient averaging overlapped with backward (``DataParallel``)."""

from fastpar.data_parallel.buckets import Bucket, plan_buckets
from fastpar.data_parallel.wrapper import DataParallel

__all__ = ["Bucket", "DataParallel", "plan_buckets"]
