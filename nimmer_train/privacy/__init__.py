"""Privacy machinery: device-side anonymisation of A.2 uploads and the server's A.2 intake pool."""
