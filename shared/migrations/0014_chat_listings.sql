-- What a chat is about (Avito: the listing of a u2i chat: title, price, url), for the reply
-- writer; cached per chat and read again after a while (services/responder/listings.py).
-- Its own table: a chat's first reply needs it, and a chat has no `chats` row (whose
-- last-answered marker is required) until it was answered. So the columns 0010 put in
-- `chats` for it go.
CREATE TABLE chat_listings (
    chat_key   text PRIMARY KEY,
    -- {"title", "price", "url"}; NULL: the platform says the chat is about no listing.
    listing    jsonb CHECK (listing IS NULL OR jsonb_typeof(listing->'title') = 'string'),
    fetched_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX chat_listings_fetched ON chat_listings (fetched_at);
ALTER TABLE chats DROP COLUMN listing, DROP COLUMN listing_fetched_at;  -- chatq:destructive no release ever read or wrote them
