"""Teacher-tier backends behind one interface, a durable response cache, and the runner."""

from nimmer_train.synth.teacher.backends import make_teacher
from nimmer_train.synth.teacher.base import Teacher, TeacherFatalError, TeacherReply, TeacherUnavailable
from nimmer_train.synth.teacher.cache import ResponseCache
from nimmer_train.synth.teacher.runner import run_requests

__all__ = [
    "ResponseCache",
    "Teacher",
    "TeacherFatalError",
    "TeacherReply",
    "TeacherUnavailable",
    "make_teacher",
    "run_requests",
]
