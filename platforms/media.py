"""What a buyer sent that is not text (a photo, a voice note, a location, a listing), as
words the bot and a person can read: a typed placeholder the model can answer ("[the
buyer sent a photo]", "[voice message, 12 s]", "[location: 55.75, 37.61]", "[listing:
Bicycle, 12 000 ₽]"), put before the buyer's own words (a caption, the words of an Avito
link) in the text the bot reads.

A buyer's message is never silence for its type: it is answered, or it goes to a person.
Some messages the bot can answer from the placeholder alone (a photo, a location, a
sticker, a listing, a missed call); others carry what the buyer meant in a form the bot
cannot read (a voice note, a video, a file): alone, without words, those are ``unreadable``
and the account's CHATQ_UNREADABLE_MESSAGES decides (``person``: stored as needs_review
with the reason; ``answer``: the bot answers the placeholder, e.g. asking the buyer to
write). Pure: payloads in, descriptions out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Media:
    """One non-text message: its kind (the platform's name), the placeholder the bot reads,
    and, when the bot cannot answer it from the placeholder alone, what it cannot do."""

    kind: str
    placeholder: str
    #: "listen to" a voice note, "watch" a video, "open" a file; None: the bot can answer it.
    cannot: str | None = None

    def text(self, words: str | None) -> str:
        """What the bot reads: the placeholder, then the buyer's own words (if any)."""
        words = (words or "").strip()
        return f"{self.placeholder} {words}" if words else self.placeholder

    def unreadable(self, words: str | None) -> str | None:
        """Why the bot cannot answer this message alone (None when it can): it carries no
        words, and the bot cannot read what it does carry."""
        if self.cannot is None or (words or "").strip():
            return None
        return f"{self.placeholder.strip('[]')}: the bot cannot {self.cannot} it"


#: The placeholder's words for an unreadable message handed to a person (intake's reason).
PERSON_HINT = "check the chat, answer the buyer, then resolve"


def duration(seconds: object) -> str | None:
    """A clip's length as a person says it: "12 s", "3 min 5 s", "2 min"."""
    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds < 0:
        return None
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    m, s = divmod(s, 60)
    return f"{m} min {s} s" if s else f"{m} min"


def coordinate(value: object) -> str | None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    return f"{value:.5f}".rstrip("0").rstrip(".")


def _join(*parts: object) -> str:
    return ", ".join(str(p) for p in parts if isinstance(p, str | int | float) and str(p).strip())


def _with(prefix: str, detail: str) -> str:
    return f"[{prefix}: {detail}]" if detail else f"[{prefix}]"


def _clip(what: str, length: str | None) -> str:
    return f"[{what}, {length}]" if length else f"[{what}]"


def _location(lat: object, lon: object, label: object = None) -> str:
    place = _join(coordinate(lat), coordinate(lon))
    if isinstance(label, str) and label.strip():
        return _with("location", f"{label.strip()} ({place})" if place else label.strip())
    return _with("location", place)


# ---- Telegram ------------------------------------------------------------------------

#: The kinds of content a Telegram buyer sends, in the order they are looked for: a venue
#: carries a location too, an animation a document, so each comes before.
TELEGRAM_KINDS = (
    "photo",
    "animation",
    "video",
    "video_note",
    "voice",
    "audio",
    "document",
    "sticker",
    "venue",
    "location",
    "contact",
    "poll",
    "dice",
    "story",
    "checklist",
    "game",
    "invoice",
    "paid_media",
    "live_photo",
    "giveaway",
)


#: A Telegram Message's fields that are about it, not what it carries.
TELEGRAM_NOT_CONTENT = frozenset(
    {
        "forward_origin", "reply_to_message", "external_reply", "quote", "entities", "via_bot",
        "author_signature", "media_group_id", "has_protected_content", "link_preview_options",
        "reply_markup", "effect_id", "sender_boost_count", "sender_tag", "direct_messages_topic",
        "is_automatic_forward", "reply_to_story", "paid_star_count", "is_paid_post",
        "suggested_post_info", "show_caption_above_media", "has_media_spoiler", "caption_entities",
        "reply_to_checklist_task_id", "reply_to_poll_option_id", "guest_query_id",
        "guest_bot_caller_user", "guest_bot_caller_chat",
    }
)  # fmt: skip
#: What Telegram reports in a chat, as a message nobody wrote (Bot API "service messages").
TELEGRAM_SERVICE = frozenset(
    {
        "new_chat_members", "left_chat_member", "chat_owner_left", "chat_owner_changed", "new_chat_title",
        "new_chat_photo", "delete_chat_photo", "group_chat_created", "supergroup_chat_created",
        "channel_chat_created", "message_auto_delete_timer_changed", "migrate_to_chat_id",
        "migrate_from_chat_id", "pinned_message", "successful_payment", "refunded_payment", "users_shared",
        "chat_shared", "gift", "unique_gift", "gift_upgrade_sent", "connected_website",
        "write_access_allowed", "passport_data", "proximity_alert_triggered", "boost_added",
        "chat_background_set", "checklist_tasks_done", "checklist_tasks_added",
        "direct_message_price_changed", "forum_topic_created", "forum_topic_edited", "forum_topic_closed",
        "forum_topic_reopened", "general_forum_topic_hidden", "general_forum_topic_unhidden",
        "giveaway_created", "giveaway_winners", "giveaway_completed", "managed_bot_created",
        "paid_message_price_changed", "poll_option_added", "poll_option_deleted", "suggested_post_approved",
        "suggested_post_approval_failed", "suggested_post_declined", "suggested_post_paid",
        "suggested_post_refunded", "video_chat_scheduled", "video_chat_started", "video_chat_ended",
        "video_chat_participants_invited", "web_app_data",
    }
)  # fmt: skip


def telegram_service(fields: Mapping[str, Any]) -> str | None:
    """The kind of service message this is (a member joined, a message pinned), or None."""
    return next((k for k in fields if k in TELEGRAM_SERVICE), None)


def telegram_media(fields: Mapping[str, Any]) -> Media | None:
    """The content of a Telegram Message beyond its text (``fields``: the message's own
    fields beyond those the receiver reads), or None when it carries none: a service
    message. Content of a kind this release does not know (a newer Bot API's) is one the
    bot cannot read: a person's, or answered, as UNREADABLE_MESSAGES says, never ignored."""
    kind = next((k for k in TELEGRAM_KINDS if fields.get(k) is not None), None)
    if kind is None:
        if telegram_service(fields) is not None:
            return None
        unknown = next(
            (k for k in fields if k not in TELEGRAM_NOT_CONTENT and fields.get(k) is not None), None
        )
        if unknown is None:
            return None
        return Media(unknown, f"[the buyer sent a {unknown.replace('_', ' ')}]", "open")
    value = fields[kind]
    v: Mapping[str, Any] = value if isinstance(value, Mapping) else {}
    length = duration(v.get("duration"))
    if kind == "photo":
        return Media(kind, "[the buyer sent a photo]")
    if kind == "animation":
        return Media(kind, "[the buyer sent a GIF]")
    if kind == "video":
        return Media(kind, _clip("the buyer sent a video", length), "watch")
    if kind == "video_note":
        return Media(kind, _clip("video message", length), "watch")
    if kind == "voice":
        return Media(kind, _clip("voice message", length), "listen to")
    if kind == "audio":
        return Media(
            kind, _with("audio file", _join(v.get("performer"), v.get("title"), length)), "listen to"
        )
    if kind == "document":
        return Media(kind, _with("file", _join(v.get("file_name"))), "open")
    if kind == "sticker":
        emoji = v.get("emoji")
        return Media(kind, f"[sticker {emoji}]" if isinstance(emoji, str) and emoji else "[sticker]")
    if kind == "venue":
        return Media(kind, _with("place", _join(v.get("title"), v.get("address"))))
    if kind == "location":
        return Media(kind, _location(v.get("latitude"), v.get("longitude")))
    if kind == "contact":
        name = " ".join(p for p in (v.get("first_name"), v.get("last_name")) if isinstance(p, str) and p)
        return Media(kind, _with("contact", _join(name, v.get("phone_number"))))
    if kind == "poll":
        return Media(kind, _with("poll", _join(v.get("question"))))
    if kind == "dice":
        return Media(kind, f"[{v.get('emoji') or 'dice'} rolled {v.get('value')}]")
    if kind == "story":
        return Media(kind, "[the buyer shared a story]")
    return Media(kind, f"[the buyer sent a {kind.replace('_', ' ')}]", "open")


# ---- Avito ---------------------------------------------------------------------------

#: Avito's message types a buyer writes (its documents' enums), beyond text. "system"
#: (Avito itself) and "deleted" are no buyer's words.
AVITO_CONTENT_KEYS = ("image", "voice", "location", "item", "link", "call")


def avito_media(kind: str, content: Mapping[str, Any]) -> tuple[Media, str | None] | None:
    """An Avito message of ``kind`` (its ``type``) with ``content``: the media and the
    buyer's own words in it (the text of a link); None for text. Avito gives an empty
    content for file, video and appCall ("not supported" in its documents)."""

    def part(name: str) -> Mapping[str, Any]:
        value = content.get(name)
        return value if isinstance(value, Mapping) else {}

    if kind == "text":
        return None
    if kind == "image":
        return Media(kind, "[the buyer sent a photo]"), None
    if kind == "voice":
        return Media(kind, "[voice message]", "listen to"), None
    if kind == "video":
        return Media(kind, "[the buyer sent a video]", "watch"), None
    if kind == "file":
        return Media(kind, "[the buyer sent a file]", "open"), None
    if kind == "location":
        loc = part("location")
        label = loc.get("text") or loc.get("title")
        return Media(kind, _location(loc.get("lat"), loc.get("lon"), label)), None
    if kind == "item":
        item = part("item")
        return Media(
            kind, _with("listing", _join(item.get("title"), item.get("price_string"), item.get("item_url")))
        ), None
    if kind == "link":
        link = part("link")
        url, words = link.get("url"), link.get("text")
        words = words if isinstance(words, str) and words.strip() and words != url else None
        return Media(kind, _with("link", _join(url))), words
    if kind in ("call", "appCall"):
        call = part("call")
        missed = call.get("status") == "missed" or kind == "appCall"
        return Media(kind, "[the buyer tried to call: a missed call]" if missed else "[a call]"), None
    return Media(kind, f"[the buyer sent a message of a type the bot does not know: {kind}]", "read"), None
