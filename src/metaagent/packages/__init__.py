"""npm packages for sandboxed code: which ones a request may have (`policy`), how they are installed
without running any of their code (`install`), and how an installed set is cached and handed to the
sandbox as a read-only volume (`store`)."""
