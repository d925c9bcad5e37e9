"""The model server: OpenAI's completions API over checkpoints verified against the chain.

`start_model_server(rpc_url, deployment, epoch, port)` pulls and verifies a round (or follows the
chain's newest), serves it on 127.0.0.1 and returns a `ModelServerHandle` (`.url`, `.stop()`);
`gonka-node serve` is the same from the command line. Modules: docs/ARCHITECTURE.md; operation and
the production path with vLLM: docs/SERVING.md; the HTTP contract: docs/PROTOCOL.md "Model serving".
"""

from gonka_node.serve.server import ModelServerHandle, ServeSettings, serve_verified, start_model_server

__all__ = ["ModelServerHandle", "ServeSettings", "serve_verified", "start_model_server"]
