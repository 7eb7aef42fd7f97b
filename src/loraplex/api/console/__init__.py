"""The web console served at /console: plain HTML pages rendered on the server, SVG charts, one small
script that refreshes each page's live part; no build step. routes.py is the entry point."""
