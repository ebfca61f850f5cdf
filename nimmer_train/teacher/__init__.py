"""Teacher-tier backends behind one interface, a durable response cache, and the runner."""

from nimmer_train.teacher.backends import make_teacher
from nimmer_train.teacher.base import Teacher, TeacherConfig, TeacherFatalError, TeacherReply
from nimmer_train.teacher.cache import ResponseCache
from nimmer_train.teacher.runner import run_requests

__all__ = [
    "ResponseCache",
    "Teacher",
    "TeacherConfig",
    "TeacherFatalError",
    "TeacherReply",
    "make_teacher",
    "run_requests",
]
