"""The network explorer: chain events indexed into SQLite, aggregator reports checked against the
chain, and a read-only web app (HTML pages that update live, a JSON API, server-made SVG charts).

    handle = start_explorer(rpc_url, deployment_path, port=0, db_path=None)
    print(handle.url); ...; handle.stop()

Modules: `db` (the index file), `decode` (logs → rows), `indexer` (follow blocks, undo reorgs),
`reports` (aggregators' round results, verified), `downloads` (checkpoint pass-through), `queries`
(read models), `markup`/`charts`/`pages` (escaped HTML and SVG), `web` (aiohttp routes), `service`
(threads and the entry point). The API is documented in docs/EXPLORER.md.
"""

from gonka_node.explorer.db import IndexFileError
from gonka_node.explorer.service import Explorer, ExplorerOptions, ExplorerStartError, start_explorer

__all__ = ["Explorer", "ExplorerOptions", "ExplorerStartError", "IndexFileError", "start_explorer"]
