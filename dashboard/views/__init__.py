"""The dashboard's views: each ``render(run, params)`` draws one page and adds the query
parameters that make its state shareable to ``params``."""
