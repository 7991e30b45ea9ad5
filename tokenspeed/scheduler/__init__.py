"""Phase-free scheduling under a token budget (see scheduler.py)."""

from tokenspeed.scheduler.batch import ScheduledBatch, ScheduledRequest
from tokenspeed.scheduler.scheduler import Scheduler

__all__ = ["ScheduledBatch", "ScheduledRequest", "Scheduler"]
