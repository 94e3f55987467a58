"""Where `deepseek-v41-vl serve` hooks into `transformers serve`: the model type in transformers'
table of multimodal LMs, and the processor the server loads (`serve_processor.py`).

transformers has no public hook for either, and its server's internals differ between releases:

- 5.24: the API server loads the processor with ``ModelManager._load_processor`` and generates
  in its own process.
- 5.25 and later: ``ModelLoader.load_processor``, once in the API server (which renders the
  prompts) and once in the model's process, which is spawned: it sees this package only through
  the loader, so the loader is a subclass defined here (pickled by reference) that registers the
  model before loading.

:func:`install` checks which layout is there and refuses, naming the transformers version, any
other; :func:`check_installed` then checks that the server transformers builds loads through the
hook (5.25's `Serve` looks ``ModelLoader`` up in `model_manager` when it starts, so rebinding that
name is what it sees), and :func:`request_processor` resolves a request's model before any check
runs, so every request is checked against its model's limits.
"""

from __future__ import annotations

import os

from .serve_policy import ServeLimits

try:  # 5.25 and later
    from transformers.cli.serving.model_manager import ModelLoader as _ModelLoader
except ImportError:  # 5.24 (or no serve dependencies: `install` says so)
    _ModelLoader = None


class ServeHooksError(RuntimeError):
    """This transformers' server is not laid out as the hooks expect (names the version)."""


def register_model_type() -> None:
    """Add DeepSeek-V4.1 to transformers' multimodal-LM table (the server loads such a model with
    `AutoModelForMultimodalLM`); importing this package has registered the classes."""
    from transformers.models.auto import modeling_auto

    from .modeling.configuration_deepseek_v41_vl import DeepseekV41Config

    modeling_auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES.setdefault(
        DeepseekV41Config.model_type, "DeepseekV41ForConditionalGeneration"
    )


def _served(processor, model_id: str, limits: ServeLimits, trust_remote_code: bool):
    from transformers import AutoConfig

    from .serve_processor import serve_processor

    repo, revision = model_id.rsplit(":", 1)[0] if model_id.endswith(".gguf") else model_id, None
    if not os.path.exists(repo) and "@" in repo:  # a Hub name with its revision, `repo@rev`
        repo, _, revision = repo.partition("@")
    config = AutoConfig.from_pretrained(repo, revision=revision or None, trust_remote_code=trust_remote_code)
    return serve_processor(processor, config, limits, model_id)


if _ModelLoader is not None:

    class ServeModelLoader(_ModelLoader):
        """transformers' `ModelLoader` (5.25 and later) whose processors carry the server's limits,
        and whose model's process registers DeepSeek-V4.1 before loading."""

        # set by `install`, read when the server builds its loader; travels with the instance
        limits = ServeLimits()

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.serve_limits = type(self).limits

        def load_model_and_processor(self, *args, **kwargs):
            register_model_type()
            return super().load_model_and_processor(*args, **kwargs)

        def load_processor(self, model_id: str, *args, **kwargs):
            processor = super().load_processor(model_id, *args, **kwargs)
            return _served(processor, model_id, self.serve_limits, self.trust_remote_code)


def check_installed(model_manager) -> None:
    """Refuse to serve when the model manager transformers built does not load through the hook.

    Args:
        model_manager: the `ModelManager` the server was built with.

    Raises:
        ServeHooksError: 5.25's manager holds a loader that is not :class:`ServeModelLoader`, or
            5.24's manager class loads processors without the hook (names the transformers version).
    """
    import transformers

    loader = getattr(model_manager, "loader", None)
    if _ModelLoader is not None and loader is not None:
        hooked = isinstance(loader, ServeModelLoader)
    else:
        hooked = getattr(type(model_manager)._load_processor, "serve_hook", False)
    if not hooked:
        raise ServeHooksError(
            f"transformers {transformers.__version__}: the server's model manager loads processors without "
            "deepseek-v41-vl serve's hook, so its limits would not apply; not serving"
        )


def request_processor(handler, body: dict):
    """The processor transformers' `handler` renders `body` with: the request's model is resolved
    (and loaded, on its first request) as the handler itself does, so its record is there before
    any check (a blocking call: run it off the event loop).

    Args:
        handler: a transformers serving handler (chat completions, responses, completions).
        body: the request's JSON body (not changed), its ``model`` a string or absent.

    Raises:
        ServeHooksError: the handler has neither 5.25's ``model_manager.get_engine`` nor 5.24's
            ``_resolve_model``.
        ValueError, fastapi.HTTPException: transformers' own refusals of the model (not the one the
            server is pinned to, no model named...).
    """
    import transformers

    manager = handler.model_manager
    if callable(getattr(manager, "get_engine", None)):  # 5.25
        return manager.get_engine(body.get("model")).processor
    if callable(getattr(handler, "_resolve_model", None)):  # 5.24 (it rewrites body["model"]: a copy)
        return handler._resolve_model(dict(body))[2]
    raise ServeHooksError(
        f"transformers {transformers.__version__}: the serving handler resolves models neither with "
        "model_manager.get_engine (5.25) nor _resolve_model (5.24)"
    )


def install(limits: ServeLimits) -> None:
    """Hook this command into the transformers server of this environment (see the module doc).

    Raises:
        ServeHooksError: the server's internals are neither 5.24's nor 5.25's (the message names
            the transformers version and what is missing).
    """
    import transformers
    from transformers.cli.serving import model_manager, server

    register_model_type()
    if not callable(getattr(server, "build_server", None)):
        raise ServeHooksError(
            f"transformers {transformers.__version__}: transformers.cli.serving.server has no build_server; "
            "deepseek-v41-vl serve supports the server of transformers 5.24 and 5.25"
        )
    if _ModelLoader is not None and callable(getattr(_ModelLoader, "load_processor", None)):
        ServeModelLoader.limits = limits
        model_manager.ModelLoader = ServeModelLoader  # what `Serve` builds its loader from
        return
    manager = getattr(model_manager, "ModelManager", None)
    load_processor = getattr(manager, "_load_processor", None)
    if not callable(load_processor):
        raise ServeHooksError(
            f"transformers {transformers.__version__}: neither ModelLoader.load_processor (5.25) nor "
            "ModelManager._load_processor (5.24) is there; deepseek-v41-vl serve supports the server of "
            "transformers 5.24 and 5.25"
        )

    def load(self, model_id_and_revision, *args, **kwargs):
        processor = load_processor(self, model_id_and_revision, *args, **kwargs)
        return _served(processor, model_id_and_revision, limits, getattr(self, "trust_remote_code", False))

    load.serve_hook = True  # what `check_installed` looks for
    manager._load_processor = load
