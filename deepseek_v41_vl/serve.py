"""`deepseek-v41-vl serve`: transformers' own OpenAI-compatible server (`transformers serve`) with
this model registered.

`transformers serve` picks a model's loader from the config: a model type listed in transformers'
table of multimodal LMs (`MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES`, built-in types only) loads with
`AutoModelForMultimodalLM`, and any other type by the class named in ``architectures``, looked up
in the `transformers` namespace, where a remote-code class never is. So a converted folder does not
load under plain `transformers serve`, with or without ``--trust-remote-code``. This command adds
the model type to that table, registers the classes (importing this package does), and runs
`transformers serve` itself with the arguments given: the HTTP server, the chat template, image
loading and generation are transformers'.

One addition to the app transformers builds: a request the processor refuses (a broken data URL,
a truncated or oversized image, more images than placeholders) raises a
`DeepseekV41ProcessingError`, which the app would turn into a bare HTTP 500; it is answered with
HTTP 400 and the error's message instead, and the server goes on serving.
"""

from __future__ import annotations


def serve(argv: list[str]) -> int:
    """Run ``transformers serve ARGV`` with DeepSeek-V4.1 loadable (see the module doc).

    Args:
        argv: `transformers serve` arguments, e.g. ``[folder, "--port", "8000"]``.

    Returns:
        The server's exit status.
    """
    from transformers.cli.serving import server
    from transformers.cli.transformers import app
    from transformers.models.auto import modeling_auto

    from .modeling.configuration_deepseek_v41_vl import DeepseekV41Config

    modeling_auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES.setdefault(
        DeepseekV41Config.model_type, "DeepseekV41ForConditionalGeneration"
    )
    server.build_server = _with_processing_errors_as_400(server.build_server)
    try:
        app(args=["serve", *argv], prog_name="deepseek-v41-vl")
    except SystemExit as done:  # typer ends with SystemExit in standalone mode
        return int(done.code or 0)
    return 0


def _with_processing_errors_as_400(build_server):
    """`build_server` whose app answers a `DeepseekV41ProcessingError` with HTTP 400 (see the
    module doc)."""
    from fastapi.responses import JSONResponse

    from .processing.errors_deepseek_v41_vl import DeepseekV41ProcessingError

    def build(*args, **kwargs):
        built = build_server(*args, **kwargs)

        @built.exception_handler(DeepseekV41ProcessingError)
        async def _refused(_request, exc: DeepseekV41ProcessingError):
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error"}}, status_code=400)

        return built

    return build
