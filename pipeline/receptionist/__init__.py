"""The receptionist's domain: what the business is and offers (`business`), its booking
database (`bookings`), the tools a call acts through (`tools`), the turn plan (`plan`), the
fact guard on every spoken sentence (`guard`), and the one system prompt a call uses
(`prompt`). Nothing here knows about audio, turns or transports."""
