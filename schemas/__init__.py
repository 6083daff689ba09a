"""XSD files, installed as package data so the server finds them wherever it runs."""
