"""A catalog of 60 tools, for the pre-filter's tests: realistic names, descriptions and
parameters, a few of them close to each other (times and dates, files and pages)."""

from __future__ import annotations

from schemas import ToolSpec

_TOOLS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (
        "clock",
        "current_time",
        "Get the current time in a timezone (IANA name, e.g. Asia/Tokyo).",
        ("timezone",),
    ),
    (
        "clock",
        "convert_timezone",
        "Convert a time from one timezone to another.",
        ("time", "source", "target"),
    ),
    ("clock", "date_diff", "Count the days between two calendar dates.", ("start", "end")),
    ("math", "calculator", "Evaluate an arithmetic expression such as 17 * 23.", ("expression",)),
    (
        "math",
        "statistics",
        "Mean, median and standard deviation of a list of numbers.",
        ("numbers",),
    ),
    (
        "math",
        "unit_convert",
        "Convert a quantity between units, like miles to kilometres.",
        ("value", "source", "target"),
    ),
    (
        "math",
        "currency_convert",
        "Convert an amount of money between currencies at today's rate.",
        ("amount", "source", "target"),
    ),
    (
        "math",
        "solve_equation",
        "Solve an algebraic equation for a variable.",
        ("equation", "variable"),
    ),
    ("web", "http_fetch", "Fetch a web page by URL and return its text.", ("url",)),
    ("web", "web_search", "Search the web and return the top results with links.", ("query",)),
    ("web", "check_link", "Check whether a URL is reachable and return its HTTP status.", ("url",)),
    ("web", "rss_feed", "Read the latest items of an RSS or Atom news feed.", ("url",)),
    ("files", "read_file", "Read a text file from the workspace.", ("path",)),
    ("files", "write_file", "Write text to a file in the workspace.", ("path", "content")),
    ("files", "list_directory", "List the files in a workspace directory.", ("path",)),
    ("files", "delete_file", "Delete a file from the workspace.", ("path",)),
    ("files", "search_files", "Find files whose contents match a pattern.", ("pattern",)),
    ("files", "zip_archive", "Pack files into a zip archive.", ("paths", "output")),
    (
        "mail",
        "send_email",
        "Send an email to a recipient with a subject and body.",
        ("to", "subject", "body"),
    ),
    ("mail", "read_inbox", "List the newest messages in the user's email inbox.", ("limit",)),
    ("mail", "search_email", "Search the user's email by sender or words.", ("query",)),
    ("chat", "post_slack_message", "Post a message to a Slack channel.", ("channel", "text")),
    ("chat", "send_sms", "Send a text message to a phone number.", ("number", "text")),
    (
        "calendar",
        "create_event",
        "Create a meeting in the user's calendar.",
        ("title", "start", "end"),
    ),
    ("calendar", "list_events", "List the user's calendar events for a day.", ("day",)),
    ("calendar", "cancel_event", "Cancel a calendar event.", ("event_id",)),
    (
        "weather",
        "weather_forecast",
        "Get the weather forecast for a city for the next days.",
        ("city", "days"),
    ),
    ("weather", "air_quality", "Get the air quality index of a city.", ("city",)),
    ("maps", "geocode", "Turn a street address into latitude and longitude.", ("address",)),
    (
        "maps",
        "directions",
        "Driving or walking directions between two places.",
        ("origin", "destination"),
    ),
    (
        "maps",
        "nearby_places",
        "Find restaurants, shops or other places near a location.",
        ("location", "kind"),
    ),
    ("finance", "stock_price", "Look up the latest stock price of a ticker symbol.", ("ticker",)),
    (
        "finance",
        "crypto_price",
        "Look up the price of a cryptocurrency such as bitcoin.",
        ("coin",),
    ),
    (
        "finance",
        "loan_payment",
        "Compute the monthly payment of a loan.",
        ("principal", "rate", "years"),
    ),
    ("text", "translate", "Translate text into another language.", ("text", "language")),
    ("text", "summarize", "Summarize a long text into a few sentences.", ("text",)),
    ("text", "spell_check", "Find and fix spelling mistakes in a text.", ("text",)),
    ("text", "word_count", "Count the words and characters of a text.", ("text",)),
    ("text", "sentiment", "Tell whether a text is positive, negative or neutral.", ("text",)),
    ("code", "run_python", "Run a Python snippet in a sandbox and return its output.", ("code",)),
    ("code", "lint_code", "Lint source code and report style problems.", ("code", "language")),
    ("code", "git_log", "Show the recent commits of a git repository.", ("repository",)),
    (
        "code",
        "open_pull_request",
        "Open a pull request on a code repository.",
        ("repository", "title"),
    ),
    ("db", "sql_query", "Run a read-only SQL query against the analytics database.", ("query",)),
    ("db", "table_schema", "Describe the columns of a database table.", ("table",)),
    ("media", "generate_image", "Generate an image from a text prompt.", ("prompt",)),
    (
        "media",
        "resize_image",
        "Resize an image to a given width and height.",
        ("path", "width", "height"),
    ),
    ("media", "transcribe_audio", "Transcribe speech in an audio file to text.", ("path",)),
    ("media", "text_to_speech", "Read a text aloud into an audio file.", ("text",)),
    ("shop", "order_status", "Track the delivery status of an order.", ("order_id",)),
    ("shop", "product_search", "Search the store's catalogue for products.", ("query",)),
    ("shop", "refund_order", "Refund a customer's order.", ("order_id", "reason")),
    ("travel", "flight_status", "Get the departure and arrival status of a flight.", ("flight",)),
    (
        "travel",
        "hotel_search",
        "Find hotels in a city for given dates.",
        ("city", "check_in", "check_out"),
    ),
    (
        "travel",
        "book_train",
        "Book a train ticket between two stations.",
        ("origin", "destination", "date"),
    ),
    (
        "knowledge",
        "wikipedia",
        "Look up a topic in the encyclopedia and return its summary.",
        ("topic",),
    ),
    ("knowledge", "dictionary", "Define a word and give its synonyms.", ("word",)),
    ("knowledge", "recipe_search", "Find cooking recipes by ingredient or dish.", ("query",)),
    ("system", "disk_usage", "Report the disk space used and free on the server.", ()),
    ("system", "restart_service", "Restart a named system service.", ("service",)),
)


def catalog() -> list[ToolSpec]:
    """The 60 tools as the catalog lists them."""
    return [
        ToolSpec(
            server=server,
            name=name,
            description=description,
            input_schema={
                "type": "object",
                "properties": {p: {"type": "string"} for p in params},
                "required": list(params),
            },
        )
        for server, name, description, params in _TOOLS
    ]
