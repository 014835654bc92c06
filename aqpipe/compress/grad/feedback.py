"""Error feedback: what compression dropped this step is added back to the next step's gradient."""

from __future__ import annotations

import torch

from aqpipe.compress.grad.base import Compressor, DPGroup


class ErrorFeedback:
    """The residual memory e of one replica: compensate g → g + e, then remember (g + e) − what was sent."""

    def __init__(self) -> None:
        self.residual: torch.Tensor | None = None

    def compensate(self, flat: torch.Tensor) -> torch.Tensor:
        """This step's gradient plus what earlier steps could not send."""
        if self.residual is None or self.residual.numel() != flat.numel():
            self.residual = torch.zeros_like(flat)
        return flat + self.residual

    def update(self, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        """Keep what the compressed message failed to carry."""
        self.residual = compensated - transmitted

    def state_dict(self) -> dict:
        return {"residual": self.residual}

    def load_state_dict(self, state: dict) -> None:
        self.residual = state.get("residual")


class FeedbackCompressor(Compressor):
    """A compressor with one replica-local error-feedback memory, kept in its checkpointable state."""

    def __init__(self, dp: DPGroup) -> None:
        super().__init__(dp)
        self.feedback = ErrorFeedback()

    def state_dict(self) -> dict:
        return dict(super().state_dict(), feedback=self.feedback.state_dict())

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.feedback.load_state_dict(state.get("feedback", {}))
