"""``kvserve bench``: one tool for every performance claim, against kvserve and the servers compared with it."""
