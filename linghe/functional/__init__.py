"""autograd.Functions and the public functional ops; inputs are validated here."""
