"""Country facts from the registry package ``countryinfo`` (no hub, no network).

One concept: turn ``countryinfo``'s records into clean, sorted :class:`CountryFacts` that the default corpus and the
1-/2-hop questions are written from. Borders are resolved from ISO alpha-3 codes to country names.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple


class CountryDataError(RuntimeError):
    """``countryinfo`` is missing or returned no usable records."""


@dataclass(frozen=True)
class CountryFacts:
    """Facts about one country, as printed in its passages.

    Attributes:
        code: ISO 3166-1 alpha-3 code (stable id, e.g. "FRA").
        name: English short name ("France").
        capital: capital city ("Paris").
        region, subregion: UN region and subregion ("Europe", "Western Europe"); "" when unknown.
        borders: names of the countries sharing a land border, sorted.
        currencies: ISO 4217 currency codes ("EUR"), in the package's order.
        languages: ISO 639-1 language codes ("fr").
        demonym: "French"; "" when unknown.
        population: inhabitants (count); None when unknown.
        area: square kilometres; None when unknown.
        calling_codes: international dialling codes without "+".
        tld: internet country-code top-level domains (".fr").
    """

    code: str
    name: str
    capital: str
    region: str = ""
    subregion: str = ""
    borders: Tuple[str, ...] = ()
    currencies: Tuple[str, ...] = ()
    languages: Tuple[str, ...] = ()
    demonym: str = ""
    population: Optional[int] = None
    area: Optional[float] = None
    calling_codes: Tuple[str, ...] = ()
    tld: Tuple[str, ...] = field(default_factory=tuple)


def _as_str(value) -> str:
    if isinstance(value, list):
        value = value[0] if value else ""
    return value.strip() if isinstance(value, str) else ""


def _ascii_list(values) -> Tuple[str, ...]:
    return tuple(v for v in (values or []) if isinstance(v, str) and v and v.isascii())


def load_country_facts() -> List[CountryFacts]:
    """All countries with a name and a capital, sorted by ISO alpha-3 code (deterministic across runs).

    Returns:
        list of :class:`CountryFacts` (about 250 with ``countryinfo`` 1.0).
    Raises:
        CountryDataError: the package is not installed or yields no country with a capital.
    """
    try:
        from countryinfo import all_countries
    except ImportError as e:  # pragma: no cover - environment problem
        raise CountryDataError("package 'countryinfo' is not installed (pip install countryinfo)") from e

    # Some ISO codes appear twice (e.g. "Burma" and "Myanmar"): keep the record with the most facts, so that a
    # code names one country everywhere (borders, passages, questions).
    best: Dict[str, dict] = {}
    for c in all_countries():
        info = c.info()
        code = (info.get("ISO") or {}).get("alpha3")
        if not code or not _as_str(info.get("name")):
            continue
        rank = (len(info), _as_str(info.get("name")))
        if code not in best or rank > (len(best[code]), _as_str(best[code].get("name"))):
            best[code] = info
    infos = [best[k] for k in sorted(best)]
    code_to_name = {k: _as_str(v.get("name")) for k, v in best.items()}

    facts = []
    for info in infos:
        code = (info.get("ISO") or {}).get("alpha3")
        name = _as_str(info.get("name"))
        capital = _as_str(info.get("capital"))
        if not code or not name or not capital:
            continue
        borders = sorted({code_to_name[b] for b in info.get("borders") or [] if b in code_to_name} - {name})
        population = info.get("population")
        area = info.get("area")
        facts.append(CountryFacts(
            code=code, name=name, capital=capital,
            region=_as_str(info.get("region")), subregion=_as_str(info.get("subregion")),
            borders=tuple(borders),
            currencies=_ascii_list(info.get("currencies")),
            languages=_ascii_list(info.get("languages")),
            demonym=_as_str(info.get("demonym")),
            population=int(population) if isinstance(population, (int, float)) and population > 0 else None,
            area=float(area) if isinstance(area, (int, float)) and area > 0 else None,
            calling_codes=_ascii_list(info.get("callingCodes")),
            tld=_ascii_list(info.get("tld")),
        ))
    if not facts:
        raise CountryDataError("countryinfo returned no country with a name and a capital")
    facts.sort(key=lambda f: f.code)
    return facts
