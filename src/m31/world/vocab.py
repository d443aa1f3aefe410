"""The topic vocabulary of the synthetic marketplace, and the ad texts and brand names made from it.

Topics form a two-level hierarchy: `N_CATEGORIES` top-level categories, each with
`LEAVES_PER_CATEGORY` leaf subtopics. A leaf topic id is
``category * LEAVES_PER_CATEGORY + leaf_index``, so ``topic // LEAVES_PER_CATEGORY`` is its
category.

Every leaf carries concrete product or service noun phrases and benefit phrases; every category
carries a few adjectives that suit all of its leaves, calls to action, and brand-name words. An
ad's creative text is one of a handful of English sentence templates filled from its leaf, e.g.
"Pro-grade trail running shoes that will keep you going mile after mile. Shop now.", so a
sentence encoder places ads of one leaf close together and ads of unrelated categories apart.

Writing rules that keep every filled template grammatical: noun phrases are plural or mass
nouns (they follow "Discover", "Save on" and "Looking for" without an article), and benefit
phrases never need to agree with the noun's number ("that will ...", "so you can ...",
"built for ...", "with ...").

Text and name generation is vectorised: every random choice for all rows is drawn in a few numpy
calls, each row becomes one integer code of its choices, and only the distinct codes are turned
into strings. The number of distinct texts is bounded per leaf (templates x nouns x benefits x
adjectives x calls to action, about 1,000-2,000), which keeps a downstream embedding cache small.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from m31.data.schema import FORMATS


@dataclass(frozen=True)
class Leaf:
    name: str
    nouns: tuple[str, ...]  # plural or mass noun phrases: products and services
    benefits: tuple[str, ...]  # follow a noun phrase: "that will ...", "so you can ..."


@dataclass(frozen=True)
class Category:
    name: str
    adjectives: tuple[str, ...]  # fit every leaf of the category
    ctas: tuple[str, ...]  # calls to action for image ads
    brand_words: tuple[str, ...]  # capitalised words for advertiser names
    brand_suffixes: tuple[str, ...]  # "Athletics", "Travel", "Co."
    leaves: tuple[Leaf, ...]


def _leaf(name: str, nouns: list[str], benefits: list[str]) -> Leaf:
    return Leaf(name, tuple(nouns), tuple(benefits))


CATEGORIES: tuple[Category, ...] = (
    Category(
        "Fitness",
        ("pro-grade", "athlete-tested", "coach-approved", "top-rated"),
        ("Shop now.", "Start training today."),
        ("Stride", "Pulse", "Peak", "Iron", "Motion", "Sprint", "Flex", "Endure"),
        ("Athletics", "Fitness", "Co.", "Performance"),
        (
            _leaf(
                "Running",
                [
                    "trail running shoes",
                    "marathon training plans",
                    "GPS running watches",
                    "moisture-wicking running socks",
                    "hydration vests for runners",
                    "race-day energy gels",
                    "reflective running jackets",
                ],
                [
                    "that will keep you going mile after mile",
                    "built for your next marathon personal best",
                    "made for long runs on road and trail",
                    "so you can run a faster 10K",
                ],
            ),
            _leaf(
                "Strength Training",
                [
                    "adjustable dumbbells",
                    "Olympic barbells and weight plates",
                    "squat racks",
                    "kettlebell sets",
                    "weightlifting belts",
                    "powerlifting programs",
                    "heavy resistance bands",
                ],
                [
                    "built to help you lift heavier",
                    "that will pack on lean muscle",
                    "made for serious home gym workouts",
                    "so you can hit a new deadlift max",
                ],
            ),
            _leaf(
                "Yoga",
                [
                    "non-slip yoga mats",
                    "cork yoga blocks",
                    "online yoga classes",
                    "yoga retreats",
                    "meditation cushions",
                    "yoga stretching straps",
                    "breathwork courses",
                ],
                [
                    "that will deepen every stretch and pose",
                    "made for a calm mind and a flexible body",
                    "so you can find your flow on the mat",
                    "designed to melt away stress and tension",
                ],
            ),
            _leaf(
                "Cycling",
                [
                    "carbon road bikes",
                    "cycling helmets",
                    "padded bike shorts",
                    "indoor smart bike trainers",
                    "clipless bike pedals",
                    "bike repair kits",
                    "gravel bike tires",
                ],
                [
                    "built for fast rides and long climbs",
                    "that will make every pedal stroke count",
                    "so you can ride farther on your bike",
                    "made for road, gravel and the daily bike commute",
                ],
            ),
            _leaf(
                "Swimming",
                [
                    "anti-fog swim goggles",
                    "competition swimsuits",
                    "swimming kickboards",
                    "adult swim lessons",
                    "triathlon wetsuits",
                    "swim training fins",
                ],
                [
                    "that will help you glide through every lap",
                    "made for the pool and open water",
                    "so you can swim stronger and faster",
                    "for every swimmer from beginner to triathlete",
                ],
            ),
            _leaf(
                "Sports Nutrition",
                [
                    "whey protein powder",
                    "pre-workout supplements",
                    "creatine monohydrate",
                    "electrolyte drink mixes",
                    "high-protein bars",
                    "BCAA recovery drinks",
                    "mass gainer shakes",
                ],
                [
                    "that will fuel faster muscle recovery",
                    "made to power your toughest workouts",
                    "so you can refuel and rebuild after training",
                    "packed with protein and clean ingredients",
                ],
            ),
        ),
    ),
    Category(
        "Travel",
        ("hand-picked", "affordable", "exclusive", "traveler-favorite"),
        ("Book today.", "Plan your trip."),
        ("Voyage", "Compass", "Horizon", "Wander", "Jet", "Passport", "Nomad", "Trail"),
        ("Travel", "Journeys", "Getaways", "Tours"),
        (
            _leaf(
                "Flights",
                [
                    "cheap flight deals",
                    "last-minute airfare",
                    "round-trip plane tickets",
                    "business class upgrades",
                    "nonstop international flights",
                    "budget airline tickets",
                ],
                [
                    "that will get you there for less",
                    "so you can fly anywhere this season",
                    "with flexible dates and no hidden booking fees",
                    "to top destinations around the world",
                ],
            ),
            _leaf(
                "Hotels",
                [
                    "boutique hotel stays",
                    "luxury hotel suites",
                    "city-center hotel rooms",
                    "weekend hotel packages",
                    "airport hotel deals",
                    "hotel spa stays",
                ],
                [
                    "with free breakfast and late checkout",
                    "that will make you feel at home in any city",
                    "so you can check in and relax",
                    "steps from the best sights downtown",
                ],
            ),
            _leaf(
                "Cruises",
                [
                    "Caribbean cruises",
                    "Mediterranean cruise packages",
                    "Alaska cruise itineraries",
                    "European river cruises",
                    "cruise cabins with ocean balconies",
                    "family cruise vacations",
                ],
                [
                    "with ports of call on sunny islands",
                    "so you can sail away to paradise",
                    "with all meals and onboard entertainment included",
                    "that will set sail this summer",
                ],
            ),
            _leaf(
                "Adventure Travel",
                [
                    "guided hiking tours",
                    "African safari adventures",
                    "backpacking trips",
                    "Patagonia trekking expeditions",
                    "scuba diving trips",
                    "mountain climbing tours",
                ],
                [
                    "led by expert local guides",
                    "so you can explore the wildest places on Earth",
                    "that will take you off the beaten path",
                    "for thrill seekers and explorers",
                ],
            ),
            _leaf(
                "Luggage",
                [
                    "carry-on suitcases",
                    "hard-shell luggage sets",
                    "travel backpacks",
                    "packing cubes",
                    "travel neck pillows",
                    "TSA-approved toiletry bags",
                ],
                [
                    "that will fit in any overhead bin",
                    "built to survive every baggage carousel",
                    "so you can pack smarter for every trip",
                    "made for frequent flyers",
                ],
            ),
            _leaf(
                "Vacation Rentals",
                [
                    "beach house rentals",
                    "mountain cabin getaways",
                    "vacation villas with private pools",
                    "lakeside cottages",
                    "holiday apartment rentals",
                    "ski chalet rentals",
                ],
                [
                    "with room for the whole family",
                    "so you can unwind with a private kitchen and hot tub",
                    "that will feel like your home away from home",
                    "for a cozy weekend getaway",
                ],
            ),
        ),
    ),
    Category(
        "Food & Cooking",
        ("chef-approved", "award-winning", "fan-favorite", "premium"),
        ("Order now.", "Get cooking today."),
        ("Kettle", "Hearth", "Harvest", "Spoon", "Orchard", "Pantry", "Skillet", "Saffron"),
        ("Kitchen", "Foods", "Provisions", "& Co."),
        (
            _leaf(
                "Meal Kits",
                [
                    "weekly meal kits",
                    "ready-to-cook dinner boxes",
                    "family meal delivery plans",
                    "vegetarian meal kits",
                    "15-minute recipe boxes",
                    "keto meal kits",
                ],
                [
                    "delivered fresh to your door every week",
                    "so you can skip the grocery store",
                    "with pre-portioned ingredients and step-by-step recipes",
                    "that will make weeknight dinners easy",
                ],
            ),
            _leaf(
                "Cookware",
                [
                    "cast iron skillets",
                    "nonstick frying pans",
                    "stainless steel stock pots",
                    "enameled Dutch ovens",
                    "chef's knives",
                    "ceramic cookware sets",
                ],
                [
                    "built to last a lifetime on your stovetop",
                    "that will sear, saute and braise like a pro",
                    "so you can cook like a restaurant chef",
                    "with even heat on every burner",
                ],
            ),
            _leaf(
                "Baking",
                [
                    "stand mixers",
                    "sourdough starter kits",
                    "nonstick baking sheets",
                    "silicone cake pans",
                    "artisan bread flour",
                    "cupcake decorating kits",
                ],
                [
                    "for perfect cakes, cookies and bread",
                    "so you can bake like a pastry chef",
                    "that will fill your kitchen with the smell of fresh bread",
                    "made for home bakers of every level",
                ],
            ),
            _leaf(
                "Coffee & Tea",
                [
                    "espresso machines",
                    "single-origin coffee beans",
                    "pour-over coffee kits",
                    "loose leaf green tea",
                    "ceremonial matcha powder",
                    "burr coffee grinders",
                    "cold brew coffee makers",
                ],
                [
                    "for a perfect cup every morning",
                    "for a fresh, rich brew every day",
                    "so you can brew cafe-quality coffee at home",
                    "that will wake up your taste buds",
                ],
            ),
            _leaf(
                "Wine & Spirits",
                [
                    "red wine subscriptions",
                    "small-batch bourbon",
                    "champagne gift boxes",
                    "vineyard wine tasting tours",
                    "craft cocktail kits",
                    "aged Scotch whisky",
                ],
                [
                    "for your next dinner party",
                    "curated by expert sommeliers",
                    "so you can sip something special tonight",
                    "that will impress every guest at the bar",
                ],
            ),
            _leaf(
                "Healthy Eating",
                [
                    "organic produce boxes",
                    "gluten-free snacks",
                    "plant-based oat milk",
                    "superfood smoothie packs",
                    "low-sugar granola",
                    "healthy grocery delivery",
                ],
                [
                    "packed with vitamins and fiber",
                    "so you can eat clean without the effort",
                    "that will nourish your body every day",
                    "made with wholesome organic ingredients",
                ],
            ),
        ),
    ),
    Category(
        "Fashion",
        ("stylish", "timeless", "trendy", "elegant"),
        ("Shop the collection.", "Find your style."),
        ("Thread", "Loom", "Velvet", "Stitch", "Silk", "Linen", "Muse", "Tailor"),
        ("Apparel", "Studio", "Clothing Co.", "Boutique"),
        (
            _leaf(
                "Dresses",
                [
                    "summer maxi dresses",
                    "little black dresses",
                    "floral sundresses",
                    "wrap dresses",
                    "cocktail party dresses",
                    "linen midi dresses",
                ],
                [
                    "that will turn heads at every party",
                    "for date nights and weddings",
                    "so you can look effortlessly chic",
                    "cut to flatter every figure",
                ],
            ),
            _leaf(
                "Menswear",
                [
                    "tailored men's suits",
                    "slim-fit dress shirts",
                    "silk neckties",
                    "wool sport coats",
                    "men's chino pants",
                    "leather dress belts",
                ],
                [
                    "tailored for a sharp, confident look",
                    "so you can dress to impress at the office",
                    "made to fit you perfectly",
                    "for the modern well-dressed man",
                ],
            ),
            _leaf(
                "Sneakers",
                [
                    "limited-edition sneakers",
                    "retro basketball sneakers",
                    "white leather sneakers",
                    "high-top canvas sneakers",
                    "sneaker cleaning kits",
                    "streetwear sneaker drops",
                ],
                [
                    "for everyday street style",
                    "so you can step out in style",
                    "that will complete any streetwear outfit",
                    "straight from the hottest sneaker releases",
                ],
            ),
            _leaf(
                "Jewelry",
                [
                    "diamond engagement rings",
                    "gold hoop earrings",
                    "sterling silver necklaces",
                    "charm bracelets",
                    "personalized name necklaces",
                    "pearl stud earrings",
                ],
                [
                    "that will sparkle for a lifetime",
                    "so you can celebrate every milestone",
                    "handcrafted with ethically sourced gemstones",
                    "perfect as a gift for someone you love",
                ],
            ),
            _leaf(
                "Handbags",
                [
                    "leather tote bags",
                    "designer handbags",
                    "crossbody purses",
                    "evening clutch bags",
                    "leather wallets",
                    "mini shoulder bags",
                ],
                [
                    "crafted from buttery soft leather",
                    "with room for all your essentials",
                    "so you can carry your day in style",
                    "that will go with every outfit",
                ],
            ),
            _leaf(
                "Outerwear",
                [
                    "wool winter coats",
                    "puffer jackets",
                    "classic trench coats",
                    "leather biker jackets",
                    "waterproof parkas",
                    "cashmere scarves",
                ],
                [
                    "that will keep you warm all winter",
                    "so you can brave the cold in style",
                    "lined against wind, rain and snow",
                    "for chilly autumn days",
                ],
            ),
        ),
    ),
    Category(
        "Home & Garden",
        ("modern", "durable", "best-selling", "affordable"),
        ("Shop now.", "Refresh your home today."),
        ("Nest", "Haven", "Timber", "Bloom", "Porch", "Gable", "Grove", "Hearthstone"),
        ("Home", "Living", "Supply Co.", "Interiors"),
        (
            _leaf(
                "Furniture",
                [
                    "mid-century modern sofas",
                    "solid oak dining tables",
                    "upholstered bed frames",
                    "sectional couches",
                    "accent armchairs",
                    "wooden bookshelves",
                ],
                [
                    "built for years of everyday comfort",
                    "that will transform your living room",
                    "so you can relax in style at home",
                    "with free white-glove furniture delivery",
                ],
            ),
            _leaf(
                "Gardening",
                [
                    "vegetable seed kits",
                    "raised garden beds",
                    "organic potting soil",
                    "pruning shears",
                    "expandable garden hoses",
                    "flowering perennials",
                ],
                [
                    "for a thriving backyard garden",
                    "so you can grow your own tomatoes and herbs",
                    "that will make your flowers bloom all season",
                    "for green thumbs and beginner gardeners alike",
                ],
            ),
            _leaf(
                "Bedding",
                [
                    "organic cotton bed sheets",
                    "memory foam mattresses",
                    "down comforters",
                    "weighted blankets",
                    "silk pillowcases",
                    "mattress toppers",
                ],
                [
                    "for the best sleep of your life",
                    "so you can wake up rested every morning",
                    "that will keep you cool in bed all night",
                    "soft enough to sink into at bedtime",
                ],
            ),
            _leaf(
                "Home Decor",
                [
                    "framed wall art",
                    "decorative throw pillows",
                    "scented candles",
                    "handwoven area rugs",
                    "ceramic vases",
                    "decorative wall mirrors",
                ],
                [
                    "that will make your space feel like home",
                    "so you can refresh every room",
                    "curated by interior designers",
                    "to add warmth and personality to any room",
                ],
            ),
            _leaf(
                "Home Improvement",
                [
                    "cordless power drills",
                    "DIY tool kits",
                    "laminate flooring",
                    "interior wall paint",
                    "bathroom vanities",
                    "kitchen cabinet hardware",
                ],
                [
                    "for your next DIY renovation project",
                    "so you can remodel like a pro",
                    "that will make weekend home repairs a breeze",
                    "built for contractors and DIYers",
                ],
            ),
            _leaf(
                "Cleaning",
                [
                    "cordless vacuum cleaners",
                    "steam mops",
                    "eco-friendly cleaning sprays",
                    "microfiber cleaning cloths",
                    "carpet cleaners",
                    "laundry detergent pods",
                ],
                [
                    "that will leave every floor spotless",
                    "so you can spend less time scrubbing",
                    "tough on dirt and gentle on surfaces",
                    "for a fresh, sparkling clean house",
                ],
            ),
        ),
    ),
    Category(
        "Personal Finance",
        ("trusted", "smart", "hassle-free", "secure"),
        ("Apply now.", "Get started today."),
        ("Ledger", "Crown", "Vault", "Anchor", "Keystone", "Mint", "Fortune", "Granite"),
        ("Financial", "Capital", "Bank", "Wealth"),
        (
            _leaf(
                "Credit Cards",
                [
                    "cash back credit cards",
                    "travel rewards credit cards",
                    "0% APR balance transfer cards",
                    "no annual fee credit cards",
                    "secured credit cards",
                    "credit card sign-up bonuses",
                ],
                [
                    "that will earn you rewards on every purchase",
                    "so you can build your credit score",
                    "with no foreign transaction fees",
                    "to help you pay down credit card debt faster",
                ],
            ),
            _leaf(
                "Investing",
                [
                    "commission-free stock trading",
                    "index fund portfolios",
                    "robo-advisor accounts",
                    "retirement investment accounts",
                    "ETF investing apps",
                    "dividend stock picks",
                ],
                [
                    "so you can grow your wealth over time",
                    "that will put your money to work in the market",
                    "to help you retire early",
                    "with low fees and smart diversification",
                ],
            ),
            _leaf(
                "Insurance",
                [
                    "term life insurance",
                    "homeowners insurance",
                    "renters insurance",
                    "health insurance plans",
                    "disability insurance",
                    "umbrella insurance policies",
                ],
                [
                    "that will protect what matters most",
                    "so you can get an insurance quote in minutes",
                    "to keep your family financially secure",
                    "with coverage you can count on",
                ],
            ),
            _leaf(
                "Banking",
                [
                    "high-yield savings accounts",
                    "online checking accounts",
                    "certificates of deposit",
                    "no-fee debit cards",
                    "mobile banking apps",
                    "money market accounts",
                ],
                [
                    "with no monthly fees or minimum balance",
                    "so you can earn more interest on your savings",
                    "that will make everyday banking simple",
                    "FDIC insured for peace of mind",
                ],
            ),
            _leaf(
                "Loans & Mortgages",
                [
                    "mortgage refinancing",
                    "personal loans",
                    "student loan refinancing",
                    "first-time homebuyer mortgages",
                    "debt consolidation loans",
                    "home equity lines of credit",
                ],
                [
                    "with low fixed interest rates",
                    "so you can lower your monthly loan payments",
                    "approved in as little as 24 hours",
                    "that will help you buy your dream home",
                ],
            ),
            _leaf(
                "Taxes & Budgeting",
                [
                    "online tax filing software",
                    "budgeting apps",
                    "personal finance courses",
                    "tax preparation services",
                    "expense tracking tools",
                    "financial planning sessions",
                ],
                [
                    "so you can maximize your tax refund",
                    "that will help you stick to a monthly budget",
                    "to take control of your money",
                    "designed to save you hours at tax time",
                ],
            ),
        ),
    ),
    Category(
        "Gaming",
        ("epic", "next-level", "fan-favorite", "ultimate"),
        ("Play now.", "Level up today."),
        ("Pixel", "Quest", "Arcade", "Nova", "Rogue", "Dragon", "Glitch", "Respawn"),
        ("Games", "Studios", "Interactive", "Gaming"),
        (
            _leaf(
                "Consoles",
                [
                    "next-gen game consoles",
                    "handheld gaming consoles",
                    "console game bundles",
                    "wireless game controllers",
                    "console storage expansion cards",
                    "retro gaming consoles",
                ],
                [
                    "for lightning-fast load times and 4K graphics",
                    "so you can play your favorite console games anywhere",
                    "that will level up your living room",
                    "with hundreds of games ready to play",
                ],
            ),
            _leaf(
                "PC Gaming",
                [
                    "custom gaming PCs",
                    "mechanical gaming keyboards",
                    "RGB gaming mice",
                    "high-refresh gaming monitors",
                    "graphics cards",
                    "surround sound gaming headsets",
                ],
                [
                    "built for high frame rates and zero lag",
                    "so you can dominate every match",
                    "that will give you the competitive edge",
                    "for esports pros and weekend PC gamers",
                ],
            ),
            _leaf(
                "Mobile Games",
                [
                    "free-to-play mobile games",
                    "puzzle games for your phone",
                    "mobile strategy games",
                    "idle clicker games",
                    "mobile word games",
                    "match-three puzzle games",
                ],
                [
                    "that you can play on your phone anytime",
                    "so you can play on your daily commute",
                    "with new levels added every week",
                    "that will keep you hooked for hours",
                ],
            ),
            _leaf(
                "Board Games",
                [
                    "strategy board games",
                    "family board games",
                    "party card games",
                    "tabletop role-playing games",
                    "jigsaw puzzles",
                    "dice game sets",
                ],
                [
                    "for unforgettable game nights",
                    "so you can gather friends around the table",
                    "that will make family game night fun again",
                    "for two to eight players",
                ],
            ),
            _leaf(
                "Game Streaming",
                [
                    "game streaming setups",
                    "esports tournament passes",
                    "USB streaming microphones",
                    "video capture cards",
                    "ergonomic gaming chairs",
                    "pro gamer coaching sessions",
                ],
                [
                    "so you can stream like a pro on Twitch",
                    "that will grow your streaming channel",
                    "built for marathon gaming sessions",
                    "to take your game to the competitive level",
                ],
            ),
            _leaf(
                "RPGs",
                [
                    "open-world RPGs",
                    "fantasy adventure games",
                    "massively multiplayer online RPGs",
                    "RPG expansion packs",
                    "action RPG pre-orders",
                    "story-driven role-playing games",
                ],
                [
                    "with epic quests and legendary loot",
                    "so you can explore a vast fantasy world",
                    "that will immerse you for hundreds of hours",
                    "with deep character customization",
                ],
            ),
        ),
    ),
    Category(
        "Beauty",
        ("luxurious", "cruelty-free", "salon-quality", "cult-favorite"),
        ("Shop now.", "Discover your glow."),
        ("Glow", "Petal", "Luxe", "Rose", "Dew", "Aura", "Blush", "Lily"),
        ("Beauty", "Cosmetics", "Skin", "Labs"),
        (
            _leaf(
                "Skincare",
                [
                    "vitamin C serums",
                    "hyaluronic acid moisturizers",
                    "retinol night creams",
                    "gentle facial cleansers",
                    "mineral sunscreen",
                    "hydrating sheet masks",
                ],
                [
                    "for glowing, hydrated skin",
                    "so you can fight fine lines and wrinkles",
                    "that will even out your skin tone",
                    "dermatologist-tested for sensitive skin",
                ],
            ),
            _leaf(
                "Makeup",
                [
                    "long-wear foundation",
                    "matte liquid lipsticks",
                    "volumizing mascara",
                    "eyeshadow palettes",
                    "setting powders",
                    "makeup brush sets",
                ],
                [
                    "for a flawless makeup look that lasts all day",
                    "so you can create bold everyday looks",
                    "that will never smudge or fade",
                    "in shades for every skin tone",
                ],
            ),
            _leaf(
                "Haircare",
                [
                    "sulfate-free shampoos",
                    "deep conditioning hair masks",
                    "argan oil hair serums",
                    "curl defining creams",
                    "dry shampoos",
                    "heat protectant hair sprays",
                ],
                [
                    "for shiny, frizz-free hair",
                    "so you can love your curls again",
                    "that will repair damaged hair from root to tip",
                    "for softer, healthier hair",
                ],
            ),
            _leaf(
                "Fragrance",
                [
                    "eau de parfum",
                    "luxury colognes for men",
                    "floral perfumes",
                    "fragrance gift sets",
                    "travel-size perfume sprays",
                    "scented body mists",
                ],
                [
                    "with notes of vanilla, jasmine and amber",
                    "that will leave a lasting impression",
                    "so you can smell amazing all day",
                    "for a signature scent that is all your own",
                ],
            ),
            _leaf(
                "Nail Care",
                [
                    "gel nail polish kits",
                    "press-on nails",
                    "nail art stickers",
                    "nourishing cuticle oils",
                    "UV nail lamps",
                    "at-home manicure sets",
                ],
                [
                    "for a salon manicure at home",
                    "that will last two weeks without chipping",
                    "so you can show off perfect nails",
                    "in dozens of trending nail colors",
                ],
            ),
            _leaf(
                "Men's Grooming",
                [
                    "beard oils",
                    "cordless beard trimmers",
                    "safety razors",
                    "rich shaving creams",
                    "beard grooming kits",
                    "aftershave balms",
                ],
                [
                    "for a clean, close shave",
                    "so you can keep your beard sharp",
                    "that will soothe razor burn",
                    "made for the modern gentleman's grooming routine",
                ],
            ),
        ),
    ),
    Category(
        "Pets",
        ("vet-approved", "pet-safe", "tail-wagging", "premium"),
        ("Shop now.", "Treat your pet today."),
        ("Paw", "Whisker", "Fetch", "Tail", "Bark", "Purr", "Kibble", "Pup"),
        ("Pets", "Pet Co.", "Animal Care", "Pet Supply"),
        (
            _leaf(
                "Dog Food",
                [
                    "grain-free dog food",
                    "puppy kibble",
                    "freeze-dried dog treats",
                    "senior dog food",
                    "fresh dog food delivery",
                    "dental chews for dogs",
                ],
                [
                    "that will keep your dog healthy and happy",
                    "made with real meat and vegetables",
                    "so your pup gets the nutrition it needs",
                    "for every dog breed and size",
                ],
            ),
            _leaf(
                "Cat Supplies",
                [
                    "self-cleaning litter boxes",
                    "clumping cat litter",
                    "cat scratching posts",
                    "multi-level cat trees",
                    "interactive cat toys",
                    "wet cat food",
                ],
                [
                    "that will keep your cat entertained for hours",
                    "so your kitty stays happy indoors",
                    "for curious and playful cats",
                    "loved by cats and their humans",
                ],
            ),
            _leaf(
                "Pet Health",
                [
                    "pet insurance plans",
                    "online vet consultations",
                    "flea and tick prevention",
                    "pet vaccination packages",
                    "pet dental cleanings",
                    "pet wellness exams",
                ],
                [
                    "that will cover unexpected vet bills",
                    "so you can keep your furry friend healthy",
                    "with fast claims for your pet's care",
                    "recommended by veterinarians",
                ],
            ),
            _leaf(
                "Dog Training",
                [
                    "puppy training classes",
                    "dog walking services",
                    "no-pull dog harnesses",
                    "retractable dog leashes",
                    "clicker training kits",
                    "dog obedience courses",
                ],
                [
                    "so your dog learns to sit, stay and heel",
                    "that will make every dog walk a pleasure",
                    "for happier, well-behaved dogs",
                    "taught by certified dog trainers",
                ],
            ),
            _leaf(
                "Aquariums",
                [
                    "freshwater aquarium kits",
                    "tropical fish food",
                    "aquarium filters",
                    "coral reef tank supplies",
                    "betta fish tanks",
                    "aquarium LED lights",
                ],
                [
                    "for a thriving underwater world",
                    "so your fish stay healthy and colorful",
                    "that will turn your fish tank into a showpiece",
                    "easy to set up for beginner fishkeepers",
                ],
            ),
            _leaf(
                "Pet Grooming",
                [
                    "mobile dog grooming",
                    "gentle pet shampoos",
                    "deshedding brushes",
                    "pet hair dryers",
                    "pet grooming tables",
                    "dog spa appointments",
                ],
                [
                    "for a clean, fluffy coat",
                    "so your pet looks and smells great",
                    "that will cut pet shedding around the house",
                    "gentle on sensitive pet skin and fur",
                ],
            ),
        ),
    ),
    Category(
        "Automotive",
        ("reliable", "affordable", "top-rated", "driver-approved"),
        ("Learn more.", "See offers near you."),
        ("Motor", "Torque", "Piston", "Axle", "Gear", "Road", "Throttle", "Drive"),
        ("Motors", "Auto", "Automotive", "Garage"),
        (
            _leaf(
                "New Cars",
                [
                    "new SUVs",
                    "electric cars",
                    "hybrid sedans",
                    "full-size pickup trucks",
                    "compact crossovers",
                    "luxury sports cars",
                ],
                [
                    "with 0% financing for qualified car buyers",
                    "so you can test drive one this weekend",
                    "that will make every commute a joy",
                    "with advanced driver safety features standard",
                ],
            ),
            _leaf(
                "Used Cars",
                [
                    "certified pre-owned cars",
                    "used trucks under $20,000",
                    "low-mileage used sedans",
                    "used car financing",
                    "vehicle history reports",
                    "car trade-in appraisals",
                ],
                [
                    "inspected and backed by a warranty",
                    "so you can drive away with a great deal",
                    "that will fit your car budget",
                    "with transparent pricing and no haggling at the dealership",
                ],
            ),
            _leaf(
                "Car Parts",
                [
                    "all-weather floor mats",
                    "performance brake pads",
                    "LED headlight bulbs",
                    "rooftop cargo boxes",
                    "car seat covers",
                    "dash cams",
                ],
                [
                    "for a perfect fit in your vehicle",
                    "so you can upgrade your ride",
                    "that will protect your car's interior",
                    "built for every make and model",
                ],
            ),
            _leaf(
                "Auto Repair",
                [
                    "oil change service",
                    "brake repair",
                    "wheel alignment service",
                    "car detailing",
                    "check engine diagnostics",
                    "transmission repair",
                ],
                [
                    "done right by certified mechanics",
                    "so you can get back on the road fast",
                    "that will keep your car running smoothly",
                    "with same-day auto shop appointments",
                ],
            ),
            _leaf(
                "Tires",
                [
                    "all-season tires",
                    "winter snow tires",
                    "performance tires",
                    "off-road truck tires",
                    "tire installation packages",
                    "run-flat tires",
                ],
                [
                    "for confident grip in rain and snow",
                    "so you can drive safely in every season",
                    "that will last for 60,000 miles",
                    "with free tire mounting and balancing",
                ],
            ),
            _leaf(
                "Motorcycles",
                [
                    "sport motorcycles",
                    "cruiser motorcycles",
                    "full-face motorcycle helmets",
                    "leather riding jackets",
                    "dirt bikes",
                    "motorcycle saddlebags",
                ],
                [
                    "built for the open road",
                    "so you can feel the thrill of the ride",
                    "that will turn heads at every stoplight",
                    "for weekend rides and cross-country motorcycle tours",
                ],
            ),
        ),
    ),
    Category(
        "Parenting",
        ("parent-approved", "trusted", "award-winning", "affordable"),
        ("Shop now.", "Join thousands of happy parents."),
        ("Cradle", "Sprout", "Lullaby", "Acorn", "Bumble", "Tot", "Nursery", "Pebble"),
        ("Kids", "Baby", "Family", "& Co."),
        (
            _leaf(
                "Baby Gear",
                [
                    "convertible car seats",
                    "lightweight baby strollers",
                    "baby carriers",
                    "baby high chairs",
                    "portable cribs",
                    "video baby monitors",
                ],
                [
                    "designed with your baby's safety first",
                    "so you can take your little one anywhere",
                    "that will grow with your baby",
                    "loved by new parents everywhere",
                ],
            ),
            _leaf(
                "Diapers & Baby Care",
                [
                    "eco-friendly diapers",
                    "sensitive baby wipes",
                    "diaper rash cream",
                    "gentle baby bath wash",
                    "reusable cloth diapers",
                    "diaper subscription boxes",
                ],
                [
                    "gentle on your baby's delicate skin",
                    "so you never run out of diapers in the middle of the night",
                    "that will keep your baby dry all night",
                    "with no fragrances or harsh chemicals",
                ],
            ),
            _leaf(
                "Toys",
                [
                    "wooden building blocks",
                    "STEM learning toys",
                    "plush stuffed animals",
                    "ride-on toys",
                    "wooden dollhouses",
                    "toddler activity boards",
                ],
                [
                    "that will spark your child's imagination",
                    "for hours of screen-free play",
                    "so your kids learn while they play",
                    "safe for toddlers and preschoolers",
                ],
            ),
            _leaf(
                "Kids' Learning",
                [
                    "online tutoring for kids",
                    "reading apps for children",
                    "math enrichment classes",
                    "coding classes for kids",
                    "homework help for students",
                    "preschool curriculum kits",
                ],
                [
                    "so your child can get ahead in school",
                    "that will build confidence in reading and math",
                    "taught by certified teachers",
                    "for kids from kindergarten to high school",
                ],
            ),
            _leaf(
                "Kids' Clothing",
                [
                    "toddler pajamas",
                    "kids' rain boots",
                    "organic cotton baby onesies",
                    "school uniforms",
                    "kids' winter jackets",
                    "matching family outfits",
                ],
                [
                    "made for running, jumping and playing",
                    "so your kids stay comfy all day",
                    "that will survive every playground adventure",
                    "in sizes from newborn to tween",
                ],
            ),
            _leaf(
                "Pregnancy",
                [
                    "maternity clothes",
                    "prenatal vitamins",
                    "pregnancy pillows",
                    "nursing bras",
                    "electric breast pumps",
                    "childbirth classes",
                ],
                [
                    "for every stage of your pregnancy",
                    "so you can feel comfortable while you're expecting",
                    "recommended by midwives and OB-GYNs",
                    "that will support you and your growing baby",
                ],
            ),
        ),
    ),
    Category(
        "Consumer Electronics",
        ("cutting-edge", "next-gen", "sleek", "powerful"),
        ("Shop now.", "Order yours today."),
        ("Volt", "Circuit", "Signal", "Quantum", "Flux", "Byte", "Photon", "Echo"),
        ("Electronics", "Tech", "Labs", "Digital"),
        (
            _leaf(
                "Smartphones",
                [
                    "5G smartphones",
                    "unlocked Android phones",
                    "foldable phones",
                    "refurbished iPhones",
                    "phone cases and screen protectors",
                    "fast wireless phone chargers",
                ],
                [
                    "with all-day phone battery life",
                    "so you can capture stunning photos at night",
                    "that will keep you connected everywhere",
                    "with the fastest mobile processor yet",
                ],
            ),
            _leaf(
                "Laptops",
                [
                    "ultrabook laptops",
                    "2-in-1 touchscreen laptops",
                    "Chromebooks",
                    "laptops for students",
                    "adjustable laptop stands",
                    "USB-C docking stations",
                ],
                [
                    "for work, school and everything in between",
                    "so you can get more done on the go",
                    "with a crisp display and all-day battery",
                    "that will boot up in seconds",
                ],
            ),
            _leaf(
                "Audio",
                [
                    "noise-cancelling headphones",
                    "true wireless earbuds",
                    "portable Bluetooth speakers",
                    "soundbars",
                    "hi-fi turntables",
                    "studio monitor speakers",
                ],
                [
                    "with rich, immersive sound",
                    "so you can tune out the world and listen",
                    "that will fill any room with music",
                    "with deep bass and crystal-clear highs",
                ],
            ),
            _leaf(
                "Smart Home",
                [
                    "smart speakers with voice assistants",
                    "video doorbells",
                    "smart thermostats",
                    "smart light bulbs",
                    "home security cameras",
                    "smart plugs",
                ],
                [
                    "so you can control your home from your phone",
                    "that will save energy automatically",
                    "compatible with Alexa and Google Home",
                    "for a safer, smarter home",
                ],
            ),
            _leaf(
                "TVs & Home Theater",
                [
                    "4K OLED TVs",
                    "8K smart TVs",
                    "home theater projectors",
                    "streaming media players",
                    "TV wall mounts",
                    "surround sound systems",
                ],
                [
                    "with stunning picture quality",
                    "so you can binge your favorite shows in cinematic detail",
                    "that will turn movie night into an event",
                    "with Dolby Vision and HDR",
                ],
            ),
            _leaf(
                "Cameras & Drones",
                [
                    "mirrorless cameras",
                    "camera lenses",
                    "action cameras",
                    "4K camera drones",
                    "camera tripods",
                    "memory cards for photographers",
                ],
                [
                    "for breathtaking photos and video",
                    "so you can capture every adventure",
                    "that will take your photography to new heights",
                    "with pro-level image stabilization",
                ],
            ),
        ),
    ),
)

N_CATEGORIES = len(CATEGORIES)
LEAVES_PER_CATEGORY = 6
N_TOPICS = N_CATEGORIES * LEAVES_PER_CATEGORY

LEAVES: tuple[Leaf, ...] = tuple(leaf for cat in CATEGORIES for leaf in cat.leaves)
CATEGORY_NAMES: tuple[str, ...] = tuple(cat.name for cat in CATEGORIES)

# Calls to action by format; image ads take their category's own.
FORMAT_CTAS: dict[str, tuple[str, ...]] = {
    "video": ("Watch the video.",),
    "carousel": ("Swipe to see more.",),
}

# Sentence templates. `{Adj}` is the adjective with a capital first letter.
TEMPLATES: tuple[str, ...] = (
    "{Adj} {noun} {benefit}. {cta}",
    "Discover {adj} {noun} {benefit}. {cta}",
    "Save on {adj} {noun} {benefit}. {cta}",
    "Looking for {noun}? Explore our {adj} picks {benefit}. {cta}",
)

# Advertiser names. Shared words, coined-name syllables and the name patterns.
BRAND_GENERIC: tuple[str, ...] = (
    "Summit", "North", "Blue", "Bright", "Golden", "Oak", "River", "Harbor",
    "Silver", "Maple", "Cedar", "Evergreen", "True", "Bold", "Clear", "Red",
    "Stone", "Sun", "Wild", "Pine", "Alder", "Atlas", "Beacon", "Crest",
    "Meadow", "Willow", "Copper", "Hudson", "Sterling", "Juniper", "Ember", "Coastal",
)  # fmt: skip
BRAND_SYL_START: tuple[str, ...] = (
    "Ve", "Lu", "Ka", "Zo", "Mi", "No", "Ari", "Bel",
    "Cor", "Dal", "El", "Fen", "Ta", "Sol", "Ren", "Vi",
)  # fmt: skip
BRAND_SYL_END: tuple[str, ...] = (
    "ra", "lo", "na", "via", "tix", "ora", "ani", "ux", "ly", "ova", "ari", "eno",
)  # fmt: skip
# Name patterns: 0 "Summit Stride Athletics", 1 "Northpulse Fitness", 2 "Velora Travel",
# 3 "Oak & Kettle".
_N_NAME_PATTERNS = 4

_FORMAT_INDEX = {f: i for i, f in enumerate(FORMATS)}

assert all(len(c.leaves) == LEAVES_PER_CATEGORY for c in CATEGORIES)
assert all(f in _FORMAT_INDEX for f in FORMAT_CTAS)


def topic_names() -> list[str]:
    """Leaf names by topic id, "Category / Leaf"."""
    return [f"{cat.name} / {leaf.name}" for cat in CATEGORIES for leaf in cat.leaves]


def topic_category(topic_ids: np.ndarray) -> np.ndarray:
    """The category id of each leaf topic id (int64)."""
    t = _check_topics(topic_ids)
    return t // LEAVES_PER_CATEGORY


def _check_topics(topics: np.ndarray) -> np.ndarray:
    t = np.asarray(topics)
    if t.size and t.dtype.kind not in "iu":
        raise TypeError(f"topic ids must be integers, got dtype {t.dtype}")
    t = t.astype(np.int64, copy=False)
    if t.size and (t.min() < 0 or t.max() >= N_TOPICS):
        raise ValueError(f"topic ids must lie in [0, {N_TOPICS}), got {t.min()}..{t.max()}")
    return t


def _flat(groups: list[tuple[str, ...]]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Concatenate groups of phrases: the flat list, each group's offset and length."""
    counts = np.array([len(g) for g in groups], dtype=np.int64)
    offsets = np.zeros(len(groups), dtype=np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    return [p for g in groups for p in g], offsets, counts


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


class _Tables:
    """Flat phrase tables with per-topic (or per-category) offsets, built once."""

    def __init__(self) -> None:
        self.nouns, self.noun_off, self.noun_cnt = _flat([lf.nouns for lf in LEAVES])
        self.benefits, self.ben_off, self.ben_cnt = _flat([lf.benefits for lf in LEAVES])
        self.adjs, self.adj_off, self.adj_cnt = _flat([c.adjectives for c in CATEGORIES])
        self.adjs_cap = [_cap(a) for a in self.adjs]
        # CTAs per (category, format), row = category * len(FORMATS) + format.
        cta_groups = [FORMAT_CTAS.get(fmt, cat.ctas) for cat in CATEGORIES for fmt in FORMATS]
        self.ctas, self.cta_off, self.cta_cnt = _flat(cta_groups)
        self.words, self.word_off, self.word_cnt = _flat([c.brand_words for c in CATEGORIES])
        self.suffixes, self.suf_off, self.suf_cnt = _flat([c.brand_suffixes for c in CATEGORIES])


_TABLES: _Tables | None = None


def _tables() -> _Tables:
    global _TABLES
    if _TABLES is None:
        _TABLES = _Tables()
    return _TABLES


def _pick(u: np.ndarray, offsets: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Flat index of a uniform choice within each row's group, from uniforms u in [0, 1)."""
    return offsets + np.minimum((u * counts).astype(np.int64), counts - 1)


def _materialise(codes: np.ndarray, build) -> list[str]:
    """Strings for integer codes, building each distinct code's string once."""
    if codes.size == 0:
        return []
    uniq, inverse = np.unique(codes, return_inverse=True)
    strings = np.array(build(uniq), dtype=object)
    return strings[inverse.reshape(-1)].tolist()


def _format_index(formats: np.ndarray | None, n: int) -> np.ndarray:
    if formats is None:
        return np.zeros(n, dtype=np.int64)  # image: the category's own calls to action
    f = np.asarray(formats)
    if f.shape != (n,):
        raise ValueError(f"formats has shape {f.shape}, expected ({n},)")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if f.dtype.kind in "iu":
        fi = f.astype(np.int64)
        if fi.min() < 0 or fi.max() >= len(FORMATS):
            raise ValueError(f"format codes must lie in [0, {len(FORMATS)})")
        return fi
    names, inverse = np.unique(f.astype(str), return_inverse=True)
    unknown = [s for s in names.tolist() if s not in _FORMAT_INDEX]
    if unknown:
        raise ValueError(f"unknown ad formats {unknown}; expected one of {FORMATS}")
    lut = np.array([_FORMAT_INDEX[s] for s in names.tolist()], dtype=np.int64)
    return lut[inverse.reshape(-1)]


def make_texts(
    topics: np.ndarray, formats: np.ndarray | None, rng: np.random.Generator
) -> list[str]:
    """One creative text per leaf topic id in `topics`.

    `formats` (same length, optional) holds format names from `m31.data.schema.FORMATS` or
    their integer codes; it picks the call to action ("Watch the video." for video). Without it
    every ad takes its category's image calls to action. The result depends only on the inputs
    and the state of `rng`, which advances by one fixed-size draw.
    """
    t = _check_topics(topics).reshape(-1)
    n = t.size
    f = _format_index(formats, n)
    tb = _tables()
    u = rng.random((5, n))  # template, noun, benefit, adjective, call to action
    cat = t // LEAVES_PER_CATEGORY
    tpl = np.minimum((u[0] * len(TEMPLATES)).astype(np.int64), len(TEMPLATES) - 1)
    noun = _pick(u[1], tb.noun_off[t], tb.noun_cnt[t])
    ben = _pick(u[2], tb.ben_off[t], tb.ben_cnt[t])
    adj = _pick(u[3], tb.adj_off[cat], tb.adj_cnt[cat])
    g = cat * len(FORMATS) + f
    cta = _pick(u[4], tb.cta_off[g], tb.cta_cnt[g])

    radix = (len(tb.nouns), len(tb.benefits), len(tb.adjs), len(tb.ctas))
    code = tpl
    for part, base in zip((noun, ben, adj, cta), radix, strict=True):
        code = code * base + part

    def build(uniq: np.ndarray) -> list[str]:
        rest = uniq.copy()
        parts = []
        for base in reversed(radix):
            parts.append(rest % base)
            rest = rest // base
        c_i, a_i, b_i, n_i = (p.tolist() for p in parts)
        return [
            TEMPLATES[k].format(
                Adj=tb.adjs_cap[a],
                adj=tb.adjs[a],
                noun=tb.nouns[nn],
                benefit=tb.benefits[b],
                cta=tb.ctas[c],
            )
            for k, nn, b, a, c in zip(rest.tolist(), n_i, b_i, a_i, c_i, strict=True)
        ]

    return _materialise(code, build)


def make_advertiser_names(categories: np.ndarray, rng: np.random.Generator) -> list[str]:
    """A plausible brand name per advertiser, flavoured by its category ("Summit Stride Athletics").

    Names may repeat across advertisers. Deterministic given `rng`'s state.
    """
    c = np.asarray(categories)
    if c.size and c.dtype.kind not in "iu":
        raise TypeError(f"category ids must be integers, got dtype {c.dtype}")
    c = c.astype(np.int64, copy=False).reshape(-1)
    if c.size and (c.min() < 0 or c.max() >= N_CATEGORIES):
        raise ValueError(f"category ids must lie in [0, {N_CATEGORIES})")
    n = c.size
    tb = _tables()
    u = rng.random((6, n))  # pattern, generic word, category word, suffix, two syllables
    pattern = np.minimum((u[0] * _N_NAME_PATTERNS).astype(np.int64), _N_NAME_PATTERNS - 1)
    gen = _pick(u[1], np.zeros(n, np.int64), np.full(n, len(BRAND_GENERIC), np.int64))
    word = _pick(u[2], tb.word_off[c], tb.word_cnt[c])
    suf = _pick(u[3], tb.suf_off[c], tb.suf_cnt[c])
    s1 = _pick(u[4], np.zeros(n, np.int64), np.full(n, len(BRAND_SYL_START), np.int64))
    s2 = _pick(u[5], np.zeros(n, np.int64), np.full(n, len(BRAND_SYL_END), np.int64))
    # Zero the parts a pattern does not use so that equal names share a code.
    gen = np.where(pattern == 2, 0, gen)
    word = np.where(pattern == 2, 0, word)
    suf = np.where(pattern == 3, 0, suf)
    s1 = np.where(pattern == 2, s1, 0)
    s2 = np.where(pattern == 2, s2, 0)

    radix = (
        len(BRAND_GENERIC),
        len(tb.words),
        len(tb.suffixes),
        len(BRAND_SYL_START),
        len(BRAND_SYL_END),
    )
    code = pattern
    for part, base in zip((gen, word, suf, s1, s2), radix, strict=True):
        code = code * base + part

    def one(p: int, g: int, w: int, s: int, a: int, b: int) -> str:
        if p == 0:
            return f"{BRAND_GENERIC[g]} {tb.words[w]} {tb.suffixes[s]}"
        if p == 1:
            return f"{BRAND_GENERIC[g]}{tb.words[w].lower()} {tb.suffixes[s]}"
        if p == 2:
            return f"{BRAND_SYL_START[a]}{BRAND_SYL_END[b]} {tb.suffixes[s]}"
        return f"{BRAND_GENERIC[g]} & {tb.words[w]}"

    def build(uniq: np.ndarray) -> list[str]:
        rest = uniq.copy()
        parts = []
        for base in reversed(radix):
            parts.append(rest % base)
            rest = rest // base
        b_i, a_i, s_i, w_i, g_i = (p.tolist() for p in parts)
        return [one(*row) for row in zip(rest.tolist(), g_i, w_i, s_i, a_i, b_i, strict=True)]

    return _materialise(code, build)
