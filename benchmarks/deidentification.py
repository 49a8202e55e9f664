"""De-identification measured on records nobody here wrote: recall per entity type and
locale, names three ways, precision on clean text, and throughput (issue 46).

Faker (offline, fixed seed) makes identifiers in six locales (en_US, de_DE, fr_FR,
es_ES, it_IT, zh_CN) and this script places each in a sentence of that locale's
language, one identifier per record, in every record shape a region reads: chat (JSON
Lines, ``messages``), Alpaca (a JSON array, ``instruction``/``input``/``output``),
prompt/response (CSV) and text (JSON Lines), one folder per locale, with clean records
(letters with no person in them, code, maths, invoices, references, dates, amounts,
versions, tracking numbers) beside them. Each pass reads those files as a region does
(``fedciuic.data.sources``: ``discover`` and ``read_rows``; ``records.parse_record``) and
scrubs every record with ``fedciuic.data.scrubbing.scrub_record``, the call a region's
tokenisation and ``fedciuic data check`` make: the measure is the product, not a stand-in.

- **Caught**: the identifier's value no longer appears verbatim anywhere in its
  scrubbed record. **Partial**: caught, but a piece of it is still there (four
  characters in a row of its letters and digits, two for a Chinese name, that the
  record's template text does not hold).
- **Pass 1, the default region**: ``deid-entities = "direct"`` plus the offline name
  recognizers where this version has them (found at run time), no dictionary, placeholder
  replacement: recall of every pattern type, names (b), clean-text precision, throughput.
- **Pass 2, the region with its customer list**: the same plus a dictionary file of
  every generated full name: names (a).
- **Pass 3, a NER model**: a spaCy pipeline with ``PERSON`` if one is installed (names (c));
  otherwise reported as not installed.

Name precision is counted per replacement, over every record (the clean letters' roles
and team signatures included): the text each name placeholder replaced is recovered from
the original and the scrubbed record, and counts as a real name when it overlaps the
name planted there. Seeded throughout, except that Faker's zh_CN resident IDs count ages
back from today.

    .venv/bin/python benchmarks/deidentification.py [--records 2000] [--clean 1200] [--seed 0]
"""

# The templates are written in each locale's own punctuation (full-width commas, colons
# and brackets in Chinese, typographic dashes and multiplication signs).
# ruff: noqa: RUF001

from __future__ import annotations

import argparse
import csv
import datetime
import inspect
import json
import logging
import math
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from random import Random
from typing import Any

import phonenumbers
from faker import Faker
from faker.providers.credit_card import Provider as CardProvider
from report import Row, verdict  # scripts side by side

from fedciuic import config
from fedciuic.config import Fields
from fedciuic.data.records import Record, parse_record
from fedciuic.data.scrubbing import scrub_record
from fedciuic.data.sources import discover, read_rows
from fedciuic.deid import DeidSpec, Scrubber, load_dictionary, parse_entities
from fedciuic.deid import entities as deid_entities

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "deidentification.json"
LOCALES = ("en_US", "de_DE", "fr_FR", "es_ES", "it_IT", "zh_CN")
#: The numbering plan each locale's phone numbers are checked against.
PHONE_REGIONS = {"en_US": "US", "de_DE": "DE", "fr_FR": "FR", "es_ES": "ES", "it_IT": "IT"}
PHONE_REGIONS["zh_CN"] = "CN"
SHAPES = ("chat", "alpaca", "prompt-response", "text")
FILES = {
    "chat": "chat.jsonl",
    "alpaca": "alpaca.json",
    "prompt-response": "prompt-response.csv",
    "text": "text.jsonl",
}
#: Targets (issue 46): every pattern type it supports, names with a dictionary or a model,
#: clean records changed.
PATTERN_TARGET = 0.99
NAME_TARGET = 0.95
CLEAN_TARGET = 0.02

# --- What is planted ----------------------------------------------------------------

#: Each identifier record's entity, as a share of a locale's records.
SHARES = (
    ("name", 25),
    ("card", 30),
    ("phone", 12),
    ("national id", 9),
    ("e-mail", 8),
    ("IBAN", 8),
    ("IP", 8),
)
#: Faker's card types, then two it lacks, made here with a Luhn check digit: Maestro
#: at 13 to 19 digits (Faker's are 12) and UnionPay (62, 16 to 19 digits).
FAKER_CARDS = (
    "visa13",
    "visa16",
    "visa19",
    "mastercard",
    "amex",
    "discover",
    "diners",
    "jcb15",
    "jcb16",
    "maestro",
)
CARD_KINDS = (*FAKER_CARDS, "maestro 13-19", "unionpay 16-19")
NATIONAL_IDS = {
    "en_US": ("US SSN",),
    "de_DE": ("DE pension insurance no. (RVNR)",),
    "fr_FR": ("FR social security no. (NIR)",),
    "es_ES": ("ES NIF", "ES NIE"),
    "it_IT": ("IT codice fiscale",),
    "zh_CN": ("CN resident ID",),
}
#: Rows reported but not held to a target, and why.
NOT_TARGETS = {
    ("national id", "DE pension insurance no. (RVNR)"): "documented miss: no recognizer",
    ("national id", "FR social security no. (NIR)"): "documented miss: no recognizer",
    ("phone", "not a valid number"): "not a number anyone has: libphonenumber says invalid",
    ("card", "jcb16 outside 3528-3589"): "Faker's 35xx outside JCB's issued range",
    ("card", "maestro 0604"): "Faker's 0604, no issued range",
    ("phone", "valid number, digits only"): "a bare digit run is kept by design",
}
NAME_CONTEXTS = (
    "title + full name",
    "greeting",
    "title + surname",
    "self-introduction",
    "signature",
    "no cue",
)


@dataclass(frozen=True)
class Planted:
    """One identifier in a record: its table row (entity, kind), its value as written
    and how it was written (grouping, context)."""

    entity: str
    kind: str
    value: str
    style: str = ""


@dataclass
class Doc:
    """A generated record: its values as written, and the identifier planted in it
    (none: a clean record, of ``clean`` kind)."""

    rid: str
    locale: str
    shape: str
    values: dict[str, Any]
    planted: Planted | None = None
    clean: str = ""


# --- Each locale's language ---------------------------------------------------------


@dataclass(frozen=True)
class Language:
    """Sentences in a locale's language. ``{label}`` is the identifier's name, ``{x}`` the
    identifier, ``{t}`` a title, ``{body}`` a message without one; ``{a|b}`` is the
    masculine and the feminine form."""

    labels: dict[str, tuple[str, ...]]
    ask: tuple[str, ...]  # a customer's line holding an identifier
    tell: tuple[str, ...]  # an agent's
    questions: tuple[str, ...]  # lines with no identifier
    replies: tuple[str, ...]
    instructions: tuple[str, ...]
    filler: tuple[str, ...]
    system: str
    titles: tuple[tuple[str, ...], tuple[str, ...]]  # (male, female)
    names: dict[str, tuple[str, ...]]
    clean_ask: tuple[str, ...]
    clean_tell: tuple[str, ...]
    space: str = " "  # what joins sentences
    #: Titles used with a surname alone, where they differ (Spanish: Don takes a first name).
    surname_titles: tuple[tuple[str, ...], tuple[str, ...]] | None = None


EN = Language(
    labels={
        "card": ("card number", "credit card number", "card"),
        "phone": ("phone number", "mobile", "number"),
        "e-mail": ("email", "e-mail address", "email address"),
        "IBAN": ("IBAN", "bank account (IBAN)", "account"),
        "IP": ("IP address", "IP", "server address"),
        "US SSN": ("SSN", "social security number", "Social Security No."),
    },
    ask=(
        "Hi, my {label} is {x}. Can you check why the payment failed?",
        "Please update my {label} to {x}.",
        "{label}: {x}",
        "I think someone used my {label} ({x}) without permission.",
        "Could you confirm you have {x} on file as my {label}?",
        "The {label} I gave you last week was {x}, is that still correct?",
    ),
    tell=(
        "Thanks, I have saved {x} as your {label}.",
        "I found the {label} {x} on your account; is it still in use?",
        "Your request about {label} {x} has been forwarded to the security team.",
    ),
    questions=(
        "Can you help me with my account?",
        "Why was I charged twice this month?",
        "I would like to change my contact details.",
        "How long does a transfer take?",
    ),
    replies=(
        "Of course, I have updated your details.",
        "Thank you, the team will look into it today.",
        "Done. You will receive a confirmation shortly.",
        "I am sorry for the trouble; the charge has been reversed.",
    ),
    instructions=(
        "Extract the customer's request.",
        "Summarise the message in one sentence.",
        "Classify the support ticket by topic.",
        "Write a polite reply to the customer.",
    ),
    filler=(
        "The customer contacted support about a billing issue.",
        "The case was escalated to the second level.",
        "No further action is needed at this point.",
        "The branch will follow up by the end of the week.",
    ),
    system="You are a helpful support assistant for a retail bank.",
    titles=(("Mr.", "Dr.", "Mr"), ("Ms.", "Mrs.", "Dr.", "Ms")),
    names={
        "title + full name": (
            "{body} Please forward this to {t} {x}.",
            "{t} {x} asked us to look into this. {body}",
            "I spoke with {t} {x} yesterday. {body}",
        ),
        "greeting": (
            "Dear {x},\n\n{body}",
            "Dear {t} {x},\n{body}",
            "Hello {x}, {body}",
            "Hi {x},\n{body}",
        ),
        "title + surname": (
            "Dear {t} {x},\n\n{body}",
            "Good morning {t} {x}, {body}",
            "{body} I will let {t} {x} know.",
        ),
        "signature": (
            "{body}\n\nBest regards,\n{x}",
            "{body}\n\nKind regards,\n{x}\nCustomer Service",
            "{body}\nThanks,\n{x}",
            "{body}\n\nSincerely,\n{x}",
        ),
        "no cue": (
            "{body} {x} will call back tomorrow.",
            "{x} said the card was blocked. {body}",
            "{body} The form was signed by {x}.",
            "Notes from the meeting with {x}: {body}",
        ),
    },
    clean_ask=(
        "Can you explain this?\n{x}",
        "What does {x} mean here?",
        "I have a question about {x}.",
        "{x}",
        "Please check the following:\n{x}",
    ),
    clean_tell=("Sure, here it is:\n{x}", "The reference is {x}.", "{x}"),
)

DE = Language(
    labels={
        "card": ("Kartennummer", "Kreditkartennummer", "Kreditkarte"),
        "phone": ("Telefonnummer", "Handynummer", "Rufnummer"),
        "e-mail": ("E-Mail-Adresse", "E-Mail", "Mailadresse"),
        "IBAN": ("IBAN", "Kontonummer (IBAN)", "Bankverbindung"),
        "IP": ("IP-Adresse", "IP", "Serveradresse"),
        "DE pension insurance no. (RVNR)": (
            "Rentenversicherungsnummer",
            "Sozialversicherungsnummer",
        ),
    },
    ask=(
        "Hallo, meine {label} ist {x}. Können Sie prüfen, warum die Zahlung fehlgeschlagen ist?",
        "Bitte ändern Sie meine {label} auf {x}.",
        "{label}: {x}",
        "Ich glaube, jemand hat meine {label} ({x}) ohne meine Zustimmung benutzt.",
        "Können Sie bestätigen, dass Sie {x} als meine {label} gespeichert haben?",
        "Die {label}, die ich Ihnen letzte Woche gegeben habe, war {x} – stimmt das noch?",
    ),
    tell=(
        "Danke, ich habe {x} als Ihre {label} gespeichert.",
        "Ich habe die {label} {x} in Ihrem Konto gefunden; ist sie noch aktuell?",
        "Ihre Anfrage zur {label} {x} wurde an das Sicherheitsteam weitergeleitet.",
    ),
    questions=(
        "Können Sie mir mit meinem Konto helfen?",
        "Warum wurde mir diesen Monat doppelt abgebucht?",
        "Ich möchte meine Kontaktdaten ändern.",
        "Wie lange dauert eine Überweisung?",
    ),
    replies=(
        "Gerne, ich habe Ihre Angaben aktualisiert.",
        "Vielen Dank, das Team kümmert sich heute darum.",
        "Erledigt. Sie erhalten in Kürze eine Bestätigung.",
        "Entschuldigen Sie die Unannehmlichkeiten; die Buchung wurde storniert.",
    ),
    instructions=(
        "Extrahiere das Anliegen des Kunden.",
        "Fasse die Nachricht in einem Satz zusammen.",
        "Ordne das Ticket einem Thema zu.",
        "Schreibe eine höfliche Antwort an den Kunden.",
    ),
    filler=(
        "Der Kunde hat sich wegen einer Abrechnung gemeldet.",
        "Der Fall wurde an den Second-Level-Support übergeben.",
        "Derzeit sind keine weiteren Schritte nötig.",
        "Die Filiale meldet sich bis Ende der Woche.",
    ),
    system="Du bist ein hilfreicher Support-Assistent einer Bank.",
    titles=(("Herr", "Herr Dr."), ("Frau", "Frau Dr.")),
    names={
        "title + full name": (
            "{body} Bitte leiten Sie das an {t} {x} weiter.",
            "{t} {x} hat uns gebeten, das zu prüfen. {body}",
            "Ich habe gestern mit {t} {x} gesprochen. {body}",
        ),
        "greeting": (
            "Sehr geehrte{r|} {t} {x},\n\n{body}",
            "Hallo {x},\n{body}",
            "Guten Tag {t} {x},\n{body}",
            "Liebe{r|} {x},\n{body}",
        ),
        "title + surname": (
            "Sehr geehrte{r|} {t} {x},\n\n{body}",
            "Guten Tag {t} {x}, {body}",
            "{body} Ich gebe {t} {x} Bescheid.",
        ),
        "signature": (
            "{body}\n\nMit freundlichen Grüßen\n{x}",
            "{body}\n\nViele Grüße\n{x}",
            "{body}\n\nBeste Grüße,\n{x}\nKundenservice",
            "{body}\nLG {x}",
        ),
        "no cue": (
            "{body} {x} ruft morgen zurück.",
            "{x} sagte, die Karte sei gesperrt. {body}",
            "{body} Das Formular wurde von {x} unterschrieben.",
            "Notizen aus dem Gespräch mit {x}: {body}",
        ),
    },
    clean_ask=(
        "Kannst du das erklären?\n{x}",
        "Was bedeutet {x} hier?",
        "Ich habe eine Frage zu {x}.",
        "{x}",
        "Bitte prüfe Folgendes:\n{x}",
    ),
    clean_tell=("Gern, hier ist es:\n{x}", "Die Referenz lautet {x}.", "{x}"),
)

FR = Language(
    labels={
        "card": ("numéro de carte", "carte bancaire", "CB"),
        "phone": ("téléphone", "numéro de portable", "tél."),
        "e-mail": ("e-mail", "adresse mail", "courriel"),
        "IBAN": ("IBAN", "RIB (IBAN)", "compte bancaire"),
        "IP": ("adresse IP", "IP", "adresse du serveur"),
        "FR social security no. (NIR)": ("numéro de sécurité sociale", "NIR", "n° de sécu"),
    },
    ask=(
        "Bonjour, voici les informations demandées — {label} : {x}. Pouvez-vous vérifier "
        "pourquoi le paiement a échoué ?",
        "Merci de mettre à jour mes coordonnées ({label} : {x}).",
        "{label} : {x}",
        "Je pense que quelqu'un a utilisé ceci sans mon accord : {x} ({label}).",
        "Pouvez-vous confirmer que vous avez bien {x} dans mon dossier ?",
    ),
    tell=(
        "Merci, j'ai bien enregistré {x} ({label}).",
        "J'ai trouvé {x} dans votre dossier ({label}) ; est-ce toujours valable ?",
        "Votre demande concernant {x} a été transmise à l'équipe sécurité.",
    ),
    questions=(
        "Pouvez-vous m'aider avec mon compte ?",
        "Pourquoi ai-je été débité deux fois ce mois-ci ?",
        "Je voudrais modifier mes coordonnées.",
        "Combien de temps prend un virement ?",
    ),
    replies=(
        "Bien sûr, j'ai mis à jour vos informations.",
        "Merci, l'équipe s'en occupe aujourd'hui.",
        "C'est fait. Vous recevrez une confirmation sous peu.",
        "Désolé pour le désagrément ; le prélèvement a été annulé.",
    ),
    instructions=(
        "Extrais la demande du client.",
        "Résume le message en une phrase.",
        "Classe le ticket par thème.",
        "Rédige une réponse polie au client.",
    ),
    filler=(
        "Le client a contacté le service au sujet d'une facture.",
        "Le dossier a été transmis au niveau deux.",
        "Aucune autre action n'est nécessaire pour le moment.",
        "L'agence reviendra vers le client d'ici la fin de la semaine.",
    ),
    system="Tu es un assistant du service client d'une banque.",
    titles=(("M.", "Monsieur"), ("Mme", "Madame")),
    names={
        "title + full name": (
            "{body} Merci de transmettre à {t} {x}.",
            "{t} {x} nous a demandé de vérifier. {body}",
            "J'ai parlé hier avec {t} {x}. {body}",
        ),
        "greeting": (
            "Bonjour {x},\n\n{body}",
            "Ch{er|ère} {x},\n{body}",
            "Bonjour {t} {x},\n{body}",
        ),
        "title + surname": (
            "Bonjour {t} {x},\n\n{body}",
            "Ch{er|ère} {t} {x},\n{body}",
            "{body} Je préviens {t} {x}.",
        ),
        "signature": (
            "{body}\n\nCordialement,\n{x}",
            "{body}\n\nBien à vous,\n{x}",
            "{body}\n\nBien cordialement,\n{x}\nService client",
            "{body}\nMerci,\n{x}",
        ),
        "no cue": (
            "{body} {x} rappellera demain.",
            "{x} a dit que la carte était bloquée. {body}",
            "{body} Le formulaire a été signé par {x}.",
            "Notes de l'entretien avec {x} : {body}",
        ),
    },
    clean_ask=(
        "Peux-tu expliquer ceci ?\n{x}",
        "Que signifie {x} ici ?",
        "J'ai une question sur {x}.",
        "{x}",
        "Merci de vérifier ceci :\n{x}",
    ),
    clean_tell=("Bien sûr, voici :\n{x}", "La référence est {x}.", "{x}"),
)

ES = Language(
    labels={
        "card": ("número de tarjeta", "tarjeta de crédito", "tarjeta"),
        "phone": ("teléfono", "móvil", "número de teléfono"),
        "e-mail": ("correo", "email", "correo electrónico"),
        "IBAN": ("IBAN", "cuenta bancaria", "número de cuenta (IBAN)"),
        "IP": ("dirección IP", "IP", "dirección del servidor"),
        "ES NIF": ("DNI", "NIF"),
        "ES NIE": ("NIE", "número de extranjero (NIE)"),
    },
    ask=(
        "Hola, estos son mis datos — {label}: {x}. ¿Pueden revisar por qué falló el pago?",
        "Por favor, actualicen mis datos ({label}: {x}).",
        "{label}: {x}",
        "Creo que alguien ha usado esto sin mi permiso: {x} ({label}).",
        "¿Pueden confirmar que tienen {x} en mi ficha?",
    ),
    tell=(
        "Gracias, he guardado {x} ({label}).",
        "He encontrado {x} en su ficha ({label}); ¿sigue siendo válido?",
        "Su solicitud sobre {x} se ha enviado al equipo de seguridad.",
    ),
    questions=(
        "¿Me pueden ayudar con mi cuenta?",
        "¿Por qué me han cobrado dos veces este mes?",
        "Quiero cambiar mis datos de contacto.",
        "¿Cuánto tarda una transferencia?",
    ),
    replies=(
        "Por supuesto, he actualizado sus datos.",
        "Gracias, el equipo lo revisará hoy.",
        "Hecho. Recibirá una confirmación en breve.",
        "Disculpe las molestias; el cargo se ha anulado.",
    ),
    instructions=(
        "Extrae la petición del cliente.",
        "Resume el mensaje en una frase.",
        "Clasifica el ticket por tema.",
        "Escribe una respuesta cortés al cliente.",
    ),
    filler=(
        "El cliente contactó con soporte por un problema de facturación.",
        "El caso se ha escalado al segundo nivel.",
        "No hace falta hacer nada más por ahora.",
        "La oficina llamará antes del fin de semana.",
    ),
    system="Eres un asistente de atención al cliente de un banco.",
    titles=(("Don", "D.", "Sr. D."), ("Doña", "Dña.", "Sra. Dña.")),
    surname_titles=(("Sr.",), ("Sra.",)),
    names={
        "title + full name": (
            "{body} Por favor, reenvíelo a {t} {x}.",
            "{t} {x} nos pidió que lo revisáramos. {body}",
            "Ayer hablé con {t} {x}. {body}",
        ),
        "greeting": (
            "Estimad{o|a} {x}:\n\n{body}",
            "Hola {x},\n{body}",
            "Estimad{o|a} {t} {x}:\n{body}",
            "Buenos días {x}, {body}",
        ),
        "title + surname": (
            "Estimad{o|a} {t} {x}:\n\n{body}",
            "Buenos días, {t} {x}. {body}",
            "{body} Se lo comunico a{l| la} {t} {x}.",
        ),
        "signature": (
            "{body}\n\nUn saludo,\n{x}",
            "{body}\n\nAtentamente,\n{x}",
            "{body}\n\nSaludos cordiales,\n{x}\nAtención al cliente",
            "{body}\nGracias,\n{x}",
        ),
        "no cue": (
            "{body} {x} llamará mañana.",
            "{x} dijo que la tarjeta estaba bloqueada. {body}",
            "{body} El formulario lo firmó {x}.",
            "Notas de la reunión con {x}: {body}",
        ),
    },
    clean_ask=(
        "¿Puedes explicar esto?\n{x}",
        "¿Qué significa {x} aquí?",
        "Tengo una pregunta sobre {x}.",
        "{x}",
        "Revisa lo siguiente:\n{x}",
    ),
    clean_tell=("Claro, aquí está:\n{x}", "La referencia es {x}.", "{x}"),
)

IT = Language(
    labels={
        "card": ("numero di carta", "carta di credito", "carta"),
        "phone": ("telefono", "cellulare", "numero di telefono"),
        "e-mail": ("email", "indirizzo email", "posta elettronica"),
        "IBAN": ("IBAN", "conto corrente (IBAN)", "coordinate bancarie"),
        "IP": ("indirizzo IP", "IP", "indirizzo del server"),
        "IT codice fiscale": ("codice fiscale", "CF"),
    },
    ask=(
        "Buongiorno, ecco i miei dati — {label}: {x}. Potete verificare perché il pagamento "
        "non è andato a buon fine?",
        "Vi prego di aggiornare i miei dati ({label}: {x}).",
        "{label}: {x}",
        "Credo che qualcuno abbia usato questo senza il mio consenso: {x} ({label}).",
        "Potete confermare di avere {x} nella mia scheda?",
    ),
    tell=(
        "Grazie, ho registrato {x} ({label}).",
        "Ho trovato {x} nella sua scheda ({label}); è ancora valido?",
        "La sua richiesta relativa a {x} è stata inoltrata al team sicurezza.",
    ),
    questions=(
        "Potete aiutarmi con il mio conto?",
        "Perché mi è stato addebitato due volte questo mese?",
        "Vorrei cambiare i miei recapiti.",
        "Quanto tempo richiede un bonifico?",
    ),
    replies=(
        "Certo, ho aggiornato i suoi dati.",
        "Grazie, il team se ne occuperà oggi.",
        "Fatto. Riceverà a breve una conferma.",
        "Ci scusiamo per il disagio; l'addebito è stato annullato.",
    ),
    instructions=(
        "Estrai la richiesta del cliente.",
        "Riassumi il messaggio in una frase.",
        "Classifica il ticket per argomento.",
        "Scrivi una risposta cortese al cliente.",
    ),
    filler=(
        "Il cliente ha contattato l'assistenza per un problema di fatturazione.",
        "La pratica è stata inoltrata al secondo livello.",
        "Al momento non serve altro.",
        "La filiale ricontatterà il cliente entro fine settimana.",
    ),
    system="Sei un assistente del servizio clienti di una banca.",
    titles=(("Sig.", "Dott.", "Signor"), ("Sig.ra", "Dott.ssa", "Signora")),
    names={
        "title + full name": (
            "{body} Per favore inoltrate a{l|lla} {t} {x}.",
            "{t} {x} ci ha chiesto di verificare. {body}",
            "Ieri ho parlato con {il|la} {t} {x}. {body}",
        ),
        "greeting": (
            "Gentile {x},\n\n{body}",
            "Car{o|a} {x},\n{body}",
            "Gentile {t} {x},\n{body}",
            "Buongiorno {x}, {body}",
        ),
        "title + surname": (
            "Gentile {t} {x},\n\n{body}",
            "Buongiorno {t} {x}, {body}",
            "{body} Avviserò {il|la} {t} {x}.",
        ),
        "signature": (
            "{body}\n\nCordiali saluti,\n{x}",
            "{body}\n\nDistinti saluti,\n{x}",
            "{body}\n\nUn saluto,\n{x}\nServizio clienti",
            "{body}\nGrazie,\n{x}",
        ),
        "no cue": (
            "{body} {x} richiamerà domani.",
            "{x} ha detto che la carta era bloccata. {body}",
            "{body} Il modulo è stato firmato da {x}.",
            "Note dall'incontro con {x}: {body}",
        ),
    },
    clean_ask=(
        "Puoi spiegare questo?\n{x}",
        "Cosa significa {x} qui?",
        "Ho una domanda su {x}.",
        "{x}",
        "Controlla quanto segue:\n{x}",
    ),
    clean_tell=("Certo, eccolo:\n{x}", "Il riferimento è {x}.", "{x}"),
)

ZH = Language(
    labels={
        "card": ("卡号", "银行卡号", "信用卡号"),
        "phone": ("手机号", "电话", "联系电话"),
        "e-mail": ("邮箱", "电子邮箱", "邮件地址"),
        "IBAN": ("IBAN", "境外账户", "收款账号"),
        "IP": ("IP地址", "IP", "服务器地址"),
        "CN resident ID": ("身份证号", "身份证号码"),
    },
    ask=(
        "你好，我的{label}是{x}，麻烦帮我查一下为什么支付失败了。",
        "请把我的{label}改成{x}。",
        "{label}：{x}",
        "我怀疑有人盗用了我的{label}（{x}）。",
        "请确认一下你们登记的{label}是不是{x}？",
    ),
    tell=(
        "好的，已将您的{label}登记为{x}。",
        "查到您名下的{label}{x}，请问还在使用吗？",
        "关于{label}{x}的申请已转交安全团队处理。",
    ),
    questions=(
        "能帮我看看我的账户吗？",
        "为什么这个月扣了两次款？",
        "我想修改联系方式。",
        "转账一般要多久到账？",
    ),
    replies=(
        "好的，已为您更新资料。",
        "谢谢，相关团队今天会处理。",
        "已办理，稍后您会收到确认通知。",
        "抱歉给您带来不便，该笔扣款已撤销。",
    ),
    instructions=(
        "提取客户的诉求。",
        "用一句话概括这条消息。",
        "按主题对工单分类。",
        "给客户写一封礼貌的回复。",
    ),
    filler=(
        "客户因账单问题联系了客服。",
        "该工单已升级到二线处理。",
        "目前无需进一步操作。",
        "网点将在本周内回访客户。",
    ),
    system="你是一家银行的客服助手。",
    titles=(("先生",), ("女士",)),
    names={
        "title + full name": (
            "{body}请转告{x}{t}。",
            "{x}{t}请我们核实一下。{body}",
            "昨天和{x}{t}通了电话。{body}",
            "{x}经理让我联系您。{body}",
        ),
        "greeting": (
            "尊敬的{x}{t}：\n\n{body}",
            "{x}{t}您好，{body}",
            "亲爱的{x}：\n{body}",
            "{x}，你好！{body}",
        ),
        "self-introduction": (
            "我叫{x}，{body}",
            "客户{x}反映：{body}",
            "我是{x}。{body}",
            "本人{x}，{body}",
        ),
        "signature": (
            "{body}\n\n此致\n敬礼\n{x}",
            "{body}\n——{x}",
            "{body}\n\n客服专员：{x}",
            "{body}\n谢谢！\n{x}",
        ),
        "no cue": (
            "{body}{x}明天会再来。",
            "昨天{x}来网点办理了业务。{body}",
            "{body}表格由{x}签字确认。",
            "和{x}的会谈纪要：{body}",
        ),
    },
    clean_ask=(
        "能解释一下这个吗？\n{x}",
        "这里的{x}是什么意思？",
        "我有个关于{x}的问题。",
        "{x}",
        "请检查以下内容：\n{x}",
    ),
    clean_tell=("好的，内容如下：\n{x}", "编号是{x}。", "{x}"),
    space="",
)

LANGUAGES = {"en_US": EN, "de_DE": DE, "fr_FR": FR, "es_ES": ES, "it_IT": IT, "zh_CN": ZH}
_GENDERED = re.compile(r"\{([^{}|]*)\|([^{}|]*)\}")
_LATIN_END, _LATIN_START = re.compile(r"[A-Za-z0-9]$"), re.compile(r"[A-Za-z0-9]")


def filled(template: str, female: bool = False, **slots: str) -> str:
    """``template`` with its slots filled (values are inserted last, never read as slots)."""
    text = _GENDERED.sub(lambda m: m.group(2 if female else 1), template)
    label, value = slots.get("label", ""), slots["x"]
    if _LATIN_END.search(label) and _LATIN_START.match(value):
        # Chinese needs no space between words, but two Latin ones are always spaced
        # ("IBAN GB29...", "IP 10.0.0.1"): glued, they would be one word to any reader.
        text = text.replace("{label}{x}", "{label} {x}")
    for name in ("label", "t", "body"):
        if name in slots:
            text = text.replace("{" + name + "}", slots[name])
    text = text.replace("{x}", value)
    return text[:1].upper() + text[1:] if template.startswith("{label}") else text


# --- Identifiers ----------------------------------------------------------------------


def luhn_digit(body: str) -> str:
    """The check digit that makes ``body`` + it pass Luhn's test."""
    total = 0
    for i, ch in enumerate(reversed(body)):
        d = int(ch) * (2 if i % 2 == 0 else 1)  # the check digit's neighbour is doubled
        total += d - 9 if d > 9 else d
    return str(-total % 10)


def card(fake: Faker, rng: Random, kind: str) -> tuple[str, str]:
    """A card number of ``kind`` (digits only) and its table row's name."""
    if kind in FAKER_CARDS:
        digits = fake.credit_card_number(card_type=kind)
        if kind == "mastercard":
            return digits, "mastercard 2221-2720" if digits[0] == "2" else "mastercard 51-55"
        if kind == "jcb16":
            issued = 3528 <= int(digits[:4]) <= 3589
            return digits, "jcb16 3528-3589" if issued else "jcb16 outside 3528-3589"
        if kind == "maestro":
            return digits, "maestro 0604" if digits.startswith("0604") else "maestro 12"
        return digits, kind
    if kind == "maestro 13-19":
        prefixes = [p for p in CardProvider.prefix_maestro if p != "0604"]
        prefix = fake.numerify(rng.choice(prefixes))
        length = rng.randint(13, 19)
    else:  # UnionPay
        prefix, length = "62", rng.randint(16, 19)
    body = prefix + "".join(rng.choice("0123456789") for _ in range(length - len(prefix) - 1))
    return body + luhn_digit(body), kind


def grouped(digits: str, sep: str) -> str:
    """A card number as printed: 4-6-5 (15 digits), 4-6-4 (14), else groups of four."""
    n = len(digits)
    sizes: tuple[int, ...] = {15: (4, 6, 5), 14: (4, 6, 4)}.get(n, (4,) * (n // 4))
    if n not in (14, 15) and n % 4:
        sizes += (n % 4,)
    out, at = [], 0
    for size in sizes:
        out.append(digits[at : at + size])
        at += size
    return sep.join(out)


def phone_kind(number: str, locale: str) -> str:
    """Whether libphonenumber says the number is one in the locale's numbering plan, and
    if so whether it is written with a separator or a + (formatted) or as bare digits."""
    try:
        parsed = phonenumbers.parse(number, PHONE_REGIONS[locale])
    except phonenumbers.NumberParseException:
        return "not a valid number"
    if not phonenumbers.is_valid_number(parsed):
        return "not a valid number"
    return "valid number, digits only" if number.isdigit() else "valid number, formatted"


def national_id(fake: Faker, kind: str) -> str:
    """A national identity number of ``kind``, by the Faker method of its locale."""
    if kind == "DE pension insurance no. (RVNR)":
        return fake.rvnr(birthdate=_moment(fake).date())
    made: str = getattr(fake, {"ES NIF": "nif", "ES NIE": "nie"}.get(kind, "ssn"))()
    return made


@dataclass(frozen=True)
class Fakers:
    """A locale's Faker, and those its cards and IBANs come from: card numbers from an
    en_US Faker (zh_CN's has only three card types), IBANs of a UK account where the
    country has none (en_US, zh_CN; Faker's en_US IBAN is a character short)."""

    local: Faker
    cards: Faker
    banks: Faker

    @classmethod
    def of(cls, locale: str, seed: int) -> Fakers:
        made = [Faker(name) for name in (locale, "en_US", _IBAN_LOCALE.get(locale, locale))]
        for i, fake in enumerate(made):
            fake.seed_instance(f"{seed}-{locale}-{i}")
        return cls(*made)


_IBAN_LOCALE = {"en_US": "en_GB", "zh_CN": "en_GB"}


def identifier(fakers: Fakers, rng: Random, locale: str, entity: str, i: int) -> Planted:
    """The ``i``-th identifier of ``entity`` in ``locale``, written as people write it."""
    fake = fakers.local
    if entity == "card":
        digits, kind = card(fakers.cards, rng, CARD_KINDS[i % len(CARD_KINDS)])
        style = rng.choices(("plain", "spaces", "dashes"), weights=(5, 4, 1))[0]
        value = {"plain": digits, "spaces": grouped(digits, " "), "dashes": grouped(digits, "-")}
        return Planted(entity, kind, value[style], style)
    if entity == "phone":
        number = fake.phone_number()
        return Planted(entity, phone_kind(number, locale), number, "as Faker formats it")
    if entity == "national id":
        kinds = NATIONAL_IDS[locale]
        kind = kinds[i % len(kinds)]
        return Planted(entity, kind, national_id(fake, kind))
    if entity == "e-mail":
        make = rng.choice((fake.email, fake.free_email, fake.company_email))
        return Planted(entity, "e-mail", make())
    if entity == "IBAN":
        iban = fakers.banks.iban()
        style = rng.choice(("compact", "groups of four"))
        shown = iban if style == "compact" else " ".join(re.findall(".{1,4}", iban))
        return Planted(entity, "IBAN", shown, style)
    if entity == "IP":
        if i % 2:
            return Planted(entity, "IPv6", fake.ipv6())
        make = rng.choice((fake.ipv4, fake.ipv4_public, fake.ipv4_private))
        return Planted(entity, "IPv4", make())
    raise ValueError(entity)


def person(fake: Faker, rng: Random, locale: str) -> tuple[str, str, bool]:
    """A full name as the locale writes it, its surname, and whether she is a woman."""
    female = rng.random() < 0.5
    if locale == "zh_CN":
        full = fake.name_female() if female else fake.name_male()
        return full, full[:1], female
    first = fake.first_name_female() if female else fake.first_name_male()
    last = fake.last_name()
    if locale == "es_ES" and rng.random() < 0.6:  # two surnames, as Spanish names have
        last = f"{last} {fake.last_name()}"
    return f"{first} {last}", last, female


# --- Records --------------------------------------------------------------------------


def shaped(lang: Language, rng: Random, shape: str, line: str, agent: bool) -> dict[str, Any]:
    """A record of ``shape`` holding ``line`` on the customer's side (or the agent's)."""
    question, reply = rng.choice(lang.questions), rng.choice(lang.replies)
    if shape == "chat":
        turns: list[dict[str, str]] = []
        if rng.random() < 0.5:
            turns.append({"role": "system", "content": lang.system})
        if rng.random() < 0.3:  # an earlier exchange
            turns += [
                {"role": "user", "content": rng.choice(lang.questions)},
                {"role": "assistant", "content": rng.choice(lang.replies)},
            ]
        turns += [
            {"role": "user", "content": question if agent else line},
            {"role": "assistant", "content": line if agent else reply},
        ]
        return {"messages": turns}
    if shape == "alpaca":
        instruction = rng.choice(lang.instructions)
        if agent:
            return {"instruction": instruction, "input": question, "output": line}
        if rng.random() < 0.3:
            return {"instruction": line, "input": "", "output": reply}
        return {"instruction": instruction, "input": line, "output": reply}
    if shape == "prompt-response":
        return (
            {"prompt": question, "response": line} if agent else {"prompt": line, "response": reply}
        )
    before, after = rng.sample(lang.filler, 2)
    join = rng.choice((lang.space, "\n"))
    return {"text": join.join((before, line, after))}


def name_record(
    fake: Faker, rng: Random, locale: str, context: str, shape: str
) -> tuple[dict[str, Any], Planted, str]:
    """A record with a name in ``context``, the name planted and the full name (for the
    region's dictionary)."""
    lang = LANGUAGES[locale]
    full, surname, female = person(fake, rng, locale)
    agent = context != "self-introduction" and rng.random() < 0.4
    body = rng.choice(lang.replies if agent else lang.questions)
    value = surname if context == "title + surname" else full
    titles = lang.titles
    if context == "title + surname" and lang.surname_titles is not None:
        titles = lang.surname_titles
    title = rng.choice(titles[female])
    line = filled(rng.choice(lang.names[context]), female, t=title, body=body, x=value)
    values = {"text": line} if shape == "text" else shaped(lang, rng, shape, line, agent)
    return values, Planted("name", context, value, title if "title" in context else ""), full


def identifier_record(
    fakers: Fakers, rng: Random, locale: str, entity: str, i: int, shape: str
) -> tuple[dict[str, Any], Planted]:
    lang = LANGUAGES[locale]
    planted = identifier(fakers, rng, locale, entity, i)
    label_key = planted.kind if entity == "national id" else entity
    agent = rng.random() < 0.35
    template = rng.choice(lang.tell if agent else lang.ask)
    line = filled(template, label=rng.choice(lang.labels[label_key]), x=planted.value)
    return shaped(lang, rng, shape, line, agent), planted


def plan(records: int) -> list[str]:
    """A locale's identifier records by entity, in the shares of :data:`SHARES`."""
    total = sum(share for _, share in SHARES)
    exact = [(entity, records * share / total) for entity, share in SHARES]
    counts = {entity: math.floor(n) for entity, n in exact}
    by_remainder = sorted(exact, key=lambda e: e[1] - math.floor(e[1]), reverse=True)
    for entity, _ in by_remainder[: records - sum(counts.values())]:
        counts[entity] += 1
    return [entity for entity, _ in SHARES for _ in range(counts[entity])]


def generate(records: int, clean: int, seed: int) -> tuple[list[Doc], list[str]]:
    """Every record of every locale, and the full names planted (the dictionary)."""
    docs: list[Doc] = []
    names: list[str] = []
    for li, locale in enumerate(LOCALES):
        fakers = Fakers.of(locale, seed)
        fake = fakers.local
        rng = Random(f"{seed}-{locale}")
        lang = LANGUAGES[locale]
        contexts = [c for c in NAME_CONTEXTS if c in lang.names]
        seen: Counter[str] = Counter()
        for n, entity in enumerate(plan(records)):
            i = seen[entity]
            seen[entity] += 1
            rid = f"{locale}-{n:05d}"
            if entity == "name":
                context = contexts[i % len(contexts)]
                shape = SHAPES[(i // len(contexts) + li) % len(SHAPES)]
                values, planted, full = name_record(fake, rng, locale, context, shape)
                names.append(full)
            else:
                kinds = len(CARD_KINDS) if entity == "card" else 2
                shape = SHAPES[(i // kinds + li) % len(SHAPES)]
                values, planted = identifier_record(fakers, rng, locale, entity, i, shape)
            docs.append(Doc(rid, locale, shape, values, planted))
        # Clean text from its own generators: the same whatever the identifiers drew.
        fake, rng = Faker(locale), Random(f"{seed}-{locale}-clean")
        fake.seed_instance(f"{seed}-{locale}-clean")
        share = clean // len(LOCALES) + (li < clean % len(LOCALES))
        for i in range(share):
            kind = CLEAN_KINDS[i % len(CLEAN_KINDS)]
            item = CLEAN[kind](fake, rng, locale)
            agent = rng.random() < 0.35
            line = filled(rng.choice(lang.clean_tell if agent else lang.clean_ask), x=item)
            if kind == "letter":  # a whole message already
                line = item
            shape = SHAPES[(i // len(CLEAN_KINDS) + li) % len(SHAPES)]
            rid = f"{locale}-clean-{i:05d}"
            values = shaped(lang, rng, shape, line, agent)
            docs.append(Doc(rid, locale, shape, values, clean=kind))
    return docs, names


def write(docs: list[Doc], root: Path) -> int:
    """Each locale's records in one file per shape under ``root/LOCALE``; their bytes."""
    for locale in LOCALES:
        folder = root / locale
        folder.mkdir(parents=True, exist_ok=True)
        mine = [d for d in docs if d.locale == locale]
        rows = {s: [{"user_id": d.rid, **d.values} for d in mine if d.shape == s] for s in SHAPES}
        with open(folder / FILES["chat"], "w", encoding="utf-8") as out:
            out.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows["chat"])
        (folder / FILES["alpaca"]).write_text(
            json.dumps(rows["alpaca"], ensure_ascii=False, indent=1), encoding="utf-8"
        )
        with open(folder / FILES["prompt-response"], "w", encoding="utf-8", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=["user_id", "prompt", "response"])
            writer.writeheader()
            writer.writerows(rows["prompt-response"])
        with open(folder / FILES["text"], "w", encoding="utf-8") as out:
            out.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows["text"])
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# --- Clean text -----------------------------------------------------------------------


#: Dates are drawn between these (Faker's own defaults end today: a seed would not fix them).
_EARLIEST, _LATEST = datetime.datetime(1990, 1, 1), datetime.datetime(2025, 12, 31)


def _moment(fake: Faker) -> datetime.datetime:
    return fake.date_time_between_dates(_EARLIEST, _LATEST)


def _code(fake: Faker, rng: Random, locale: str) -> str:
    sha = fake.sha1()
    variants = (
        f"```python\nMAX_RETRIES = {rng.randint(3, 10)}\nTIMEOUT_MS = "
        f"{rng.choice((1500, 30000, 120000))}\nCHUNK = {2 ** rng.randint(10, 24)}\n"
        f"MASK = 0x{rng.getrandbits(32):08X}\n"
        f"assert zlib.crc32(data) == {rng.getrandbits(32)}\n```",
        f"SELECT id, total FROM orders WHERE created_at >= '{_moment(fake):%Y-%m-%d}' AND total > "
        f"{rng.randint(100, 99999)}.{rng.randint(0, 99):02d} ORDER BY id LIMIT "
        f"{rng.choice((10, 50, 100, 1000))};",
        f"docker run -d -p {(port := rng.choice((8080, 5432, 6379, 9000)))}:{port} --memory "
        f"{rng.randint(1, 16)}g registry.local/app:{rng.randint(1, 9)}.{rng.randint(0, 30)}\n"
        f"sleep {rng.randint(1, 86400)}\nsha256sum release.tar.gz  # {fake.sha256()}",
        f"git cherry-pick {sha[:7]}\ncommit {sha}\nDate:   {_moment(fake).ctime()} +0000",
        f"{_moment(fake).isoformat()} INFO worker[{rng.randint(100, 65535)}] processed "
        f"{rng.randint(1, 10**6)} rows in {rng.randint(1, 99999)} ms (request_id={fake.uuid4()})",
        f'{{"id": {rng.randint(10**9, 10**12)}, "ts": {rng.randint(1_500_000_000, 1_760_000_000)}'
        f'{rng.randint(0, 999):03d}, "ratio": {rng.random()!r}}}',
        f"#define BUFFER_SIZE {2 ** rng.randint(8, 20)}\nstatic const uint64_t SEED = "
        f"{rng.getrandbits(64)}ULL;\nvoid *p = (void *)0x{rng.getrandbits(48):012x};",
        f"np.random.seed({rng.randint(0, 2**32 - 1)})\nx = np.linspace(0, {rng.randint(1, 1000)}, "
        f"{rng.randint(10, 10**6)})",
    )
    return rng.choice(variants)


_CONSTANTS = (
    "e ~ 2.718281828459045",
    "π = 3.14159265358979323846264338327950288",
    "√2 ≈ 1.4142135623730951",
    "φ = 1.618033988749895",
    "ln 2 ≈ 0.6931471805599453",
    "Avogadro's number is 6.02214076e23",
    "h = 6.62607015 × 10^-34 J·s",
    "c = 299 792 458 m/s",
    "the Euler–Mascheroni constant γ ≈ 0.5772156649015329",
)


def _maths(fake: Faker, rng: Random, locale: str) -> str:
    a, b = rng.randint(10**3, 10**9), rng.randint(10**3, 10**9)
    k, n = rng.randint(20, 70), rng.randint(12, 25)
    fib = [0, 1]
    while len(fib) < 91:
        fib.append(fib[-1] + fib[-2])
    m = rng.randint(40, 90)
    variants = (
        f"2**{k} = {2**k}",
        rng.choice(_CONSTANTS),
        f"{a} × {b} = {a * b}",
        f"{n}! = {math.factorial(n)}",
        f"F({m}) = {fib[m]}",
        f"mean {rng.uniform(0, 1000):.6f}, standard deviation {rng.uniform(0, 50):.4f} over "
        f"{rng.randint(100, 10**6)} samples",
        f"{rng.uniform(1, 10):.3e} J",
        f"the sum of the first {n * 1000} integers is {n * 1000 * (n * 1000 + 1) // 2}",
    )
    return rng.choice(variants)


def _invoice(fake: Faker, rng: Random, locale: str) -> str:
    year = rng.randint(2010, 2025)
    variants = (
        f"invoice INV-{year}-{rng.randint(1, 999999):06d}",
        f"purchase order PO-{rng.randint(10**6, 10**8)}",
        f"PO {year}/{rng.randint(1, 99999):05d}",
        f"order #{rng.randint(10**7, 10**11)}",
        fake.bothify("??-########").upper(),
        f"SKU {fake.bothify('???-#####-##').upper()}",
        f"EAN {fake.ean13()}",
        f"customer reference {fake.bothify('CR#########')}",
        f"contract {year}-{rng.randint(1, 9999):04d}-{rng.randint(1, 999):03d}",
        f"case no. {rng.randint(10**5, 10**7)}",
    )
    return rng.choice(variants)


def _reference(fake: Faker, rng: Random, locale: str) -> str:
    year = rng.randint(1995, 2025)
    suffix = rng.choice(
        (
            str(rng.randint(10**6, 10**8)),
            f"j.cell.{year}.{rng.randint(1, 12):02d}.{rng.randint(1, 999):03d}",
            f"s{rng.randint(10000, 99999)}-{year % 100:03d}-{rng.randint(1000, 9999)}-"
            f"{rng.randint(0, 9)}",
        )
    )
    doi = f"10.{rng.randint(1000, 99999)}/{suffix}"
    variants = (
        f"DOI {doi}",
        f"https://doi.org/{doi}",
        f"arXiv:{year % 100:02d}{rng.randint(1, 12):02d}.{rng.randint(1, 99999):05d}"
        f"v{rng.randint(1, 4)}",
        f"ISBN {fake.isbn13()}",
        f"ISBN {fake.isbn10(separator='')}",
        f"PMID: {rng.randint(10**7, 4 * 10**7)}",
        f"RFC {rng.randint(791, 9999)}",
        f"vol. {rng.randint(1, 120)}, no. {rng.randint(1, 12)}, pp. "
        f"{(p := rng.randint(1, 2000))}–{p + rng.randint(5, 40)}, {year}",
        f"US Patent {rng.randint(4_000_000, 11_999_999):,}",
    )
    return rng.choice(variants)


def _datetime(fake: Faker, rng: Random, locale: str) -> str:
    moment, other = _moment(fake), _moment(fake)
    variants = (
        moment.isoformat(timespec="seconds"),
        moment.isoformat() + "Z",
        moment.strftime("%Y-%m-%d %H:%M:%S.%f"),
        moment.strftime("%d.%m.%Y %H:%M"),
        moment.strftime("%d/%m/%Y"),
        moment.strftime("%Y%m%d"),
        moment.strftime("%a, %d %b %Y %H:%M:%S +0000"),
        f"{min(moment, other):%Y-%m-%d} – {max(moment, other):%Y-%m-%d}",
        moment.strftime("%Y年%m月%d日 %H:%M"),
    )
    return rng.choice(variants)


def _amount(fake: Faker, rng: Random, locale: str) -> str:
    value = rng.uniform(1, 10 ** rng.randint(2, 8))
    plain = f"{value:,.2f}"
    grouping = {"de_DE": ".", "es_ES": ".", "it_IT": ".", "fr_FR": " "}.get(locale)
    local = plain
    if grouping is not None:
        local = plain.replace(",", "_").replace(".", ",").replace("_", grouping)
    currency = {"en_US": "$", "zh_CN": "¥"}.get(locale)
    variants = (
        fake.pricetag(),
        f"{currency}{local}" if currency else f"{local} €",
        f"{rng.choice(('USD', 'EUR', 'CNY', 'GBP'))} {local}",
        f"{value:.2f}",
        f"{local} {rng.choice(('EUR', '元', 'USD'))}",
    )
    return rng.choice(variants)


def _version(fake: Faker, rng: Random, locale: str) -> str:
    a, b, c = rng.randint(0, 20), rng.randint(0, 40), rng.randint(0, 200)
    variants = (
        f"v{a}.{b}.{c}",
        f"Python 3.{rng.randint(6, 13)}.{rng.randint(0, 15)}",
        f"version {a}.{b}.{c}-rc.{rng.randint(1, 5)}",
        f"Chrome {rng.randint(90, 130)}.0.{rng.randint(4000, 6999)}.{rng.randint(10, 250)}",
        f"Windows 10.0.{rng.randint(17000, 22999)}.{rng.randint(100, 4000)}",
        f"kernel {rng.randint(4, 6)}.{rng.randint(0, 19)}.0-{rng.randint(10, 1100)}-azure",
        f'[assembly: AssemblyVersion("{a}.{b}.{rng.randint(0, 9)}.0")]',
        f"build {_moment(fake):%Y%m%d}.{rng.randint(1, 9999)}",
        f'"requests": "^{a}.{b}.{c}"',
    )
    return rng.choice(variants)


def _tracking(fake: Faker, rng: Random, locale: str) -> str:
    usps = "".join(rng.choice("0123456789") for _ in range(18))
    variants = (
        f"UPS 1Z{fake.bothify('???###').upper()}{rng.randint(10**9, 10**10 - 1)}",
        f"FedEx {rng.randint(10**11, 10**12 - 1)}",
        "USPS " + " ".join(re.findall(".{1,4}", "9400" + usps)),
        f"DHL {rng.randint(10**9, 10**10 - 1)}",
        f"EMS EA{rng.randint(10**8, 10**9 - 1)}CN",
        f"顺丰 SF{rng.randint(10**11, 10**13 - 1)}",
        fake.bothify("??#########GB").upper(),
    )
    return rng.choice(variants)


@dataclass(frozen=True)
class Letter:
    """A locale's letters with no person in them: greetings to a role, closings signed by
    a team, and sentences whose words sit where names do (a title before a role, a
    Chinese surname character starting an ordinary word before 经理 or 客户)."""

    greetings: tuple[str, ...]
    closings: tuple[str, ...]
    lines: tuple[str, ...]


LETTERS = {
    "en_US": Letter(
        ("Dear Customer,", "Dear Sir or Madam,", "Dear Valued Customer,", "Hi team,"),
        (
            "Best regards,\nThe Support Team",
            "Kind regards,\nCustomer Service",
            "Thanks,\nBilling Department",
            "Sincerely,\nYour Bank",
        ),
        (
            "Dear Mr. President,",
            "Our Relationship Manager will call you.",
            "The Customer Service Manager will reply.",
        ),
    ),
    "de_DE": Letter(
        ("Sehr geehrte Damen und Herren,", "Liebe Kundin, lieber Kunde,", "Hallo zusammen,"),
        (
            "Mit freundlichen Grüßen\nIhr Kundenservice",
            "Viele Grüße\nDas Support-Team",
            "Beste Grüße,\nIhre Filiale",
        ),
        (
            "Sehr geehrte Frau Direktorin,",
            "Sehr geehrter Herr Vorsitzender,",
            "Die Filialleitung meldet sich bei Ihnen.",
        ),
    ),
    "fr_FR": Letter(
        ("Madame, Monsieur,", "Bonjour à tous,", "Cher client,"),
        (
            "Cordialement,\nLe service client",
            "Bien à vous,\nL'équipe Facturation",
            "Bien cordialement,\nVotre agence",
        ),
        (
            "Monsieur le Directeur,",
            "Madame la Présidente,",
            "Le Service Réclamations vous répondra.",
        ),
    ),
    "es_ES": Letter(
        ("Estimado cliente:", "Hola equipo,", "Estimados señores:"),
        (
            "Un saludo,\nEl equipo de soporte",
            "Atentamente,\nDepartamento de Atención al Cliente",
            "Saludos cordiales,\nSu oficina",
        ),
        (
            "Señor Director:",
            "Estimada Sra. Directora:",
            "El Servicio de Reclamaciones le contestará.",
        ),
    ),
    "it_IT": Letter(
        ("Gentile cliente,", "Buongiorno a tutti,", "Spettabile Ditta,"),
        (
            "Cordiali saluti,\nIl Servizio Clienti",
            "Distinti saluti,\nUfficio Reclami",
            "Un saluto,\nLa sua filiale",
        ),
        (
            "Gentile Signor Direttore,",
            "Egregio Sig. Presidente,",
            "L'Ufficio Reclami le risponderà.",
        ),
    ),
    "zh_CN": Letter(
        ("尊敬的客户：", "亲爱的用户：", "各位同事：", "您好！"),
        ("此致\n敬礼\n客户服务中心", "——客服部", "谢谢！\n信用卡中心"),
        (
            "王府井支行的经理今天不在。",
            "黄金客户享受专属优惠。",
            "白金卡客户请到二楼办理。",
            "马上联系客户经理。",
            "高新区客户请到三号窗口。",
        ),
    ),
}


def _letter(fake: Faker, rng: Random, locale: str) -> str:
    lang, letter = LANGUAGES[locale], LETTERS[locale]
    body = lang.space.join((rng.choice(letter.lines), rng.choice(lang.questions)))
    return f"{rng.choice(letter.greetings)}\n\n{body}\n\n{rng.choice(letter.closings)}"


CLEAN: dict[str, Callable[[Faker, Random, str], str]] = {
    "letter": _letter,
    "code": _code,
    "maths": _maths,
    "invoice": _invoice,
    "reference": _reference,
    "date/time": _datetime,
    "amount": _amount,
    "version": _version,
    "tracking": _tracking,
}
CLEAN_KINDS = tuple(CLEAN)
#: The clean text the <= 2 % target is for (issue 46: identifier-shaped numbers in
#: ordinary text); the letters are reported apart, and count in the names' precision.
NUMBER_KINDS = tuple(k for k in CLEAN_KINDS if k != "letter")


# --- Scrubbing through the region's own read path ------------------------------------


@dataclass(frozen=True)
class Seen:
    """A record as read, as scrubbed, and what the scrubber replaced in it."""

    original: str
    scrubbed: str
    found: Counter[str]


@dataclass
class Pass:
    name: str
    entities: tuple[str, ...]
    seen: dict[str, Seen] = field(default_factory=dict)
    seconds: float = 0.0


class _Warnings(logging.Handler):
    """Counts what Presidio logs at WARNING and above (issue 46: a line per text)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def texts(record: Record) -> str:
    return "\n\x1e\n".join((*record.parts, *(content for _, content in record.messages)))


def scrub_all(root: Path, scrubber: Scrubber, name: str) -> Pass:
    """Every record under ``root`` read, parsed and scrubbed as a region does; timed."""
    fields = Fields()
    done = Pass(name, scrubber.spec.entities)
    scrubber.scrub("warm-up 4111 1111 1111 1111")  # Presidio's engines, built once
    scrubber.findings.clear()
    with tempfile.TemporaryDirectory(prefix="fedciuic-deid-bench-") as scratch:
        # read_rows' options as this version has them (a datasets cache folder before
        # issue 46's bounded reading, the record size limit after it).
        options: dict[str, Any] = {"text_field": fields.text_field}
        accepted = inspect.signature(read_rows).parameters
        if "cache_dir" in accepted:
            options["cache_dir"] = Path(scratch)
        if "max_bytes" in accepted:
            options["max_bytes"] = getattr(config, "DEFAULT_MAX_RECORD_BYTES", 1 << 20)
        started = time.perf_counter()
        for source in discover(root):
            for row in read_rows(source, **options):
                if row.values is None:
                    raise SystemExit(f"{row.where}: {row.error}")
                record = parse_record(row.values, fields)
                before = scrubber.findings.counts.copy()
                scrubbed = scrub_record(record, scrubber, row.where, source.name)
                found = scrubber.findings.counts - before
                done.seen[str(record.user)] = Seen(texts(record), texts(scrubbed), found)
        done.seconds = time.perf_counter() - started
    return done


_PLACEHOLDER = re.compile(r"<([A-Z][A-Z0-9_]*)>")


def replaced(original: str, scrubbed: str) -> list[tuple[str, str]] | None:
    """(placeholder stem, the original text it replaced) for each placeholder, recovered
    by matching the scrubbed text's other pieces against the original; None if they
    cannot be matched."""
    pieces = _PLACEHOLDER.split(scrubbed)
    if len(pieces) == 1:
        return []
    pattern = "".join(re.escape(p) if i % 2 == 0 else "(.+?)" for i, p in enumerate(pieces))
    match = re.fullmatch(pattern, original, re.DOTALL)
    if match is None:
        return None
    return list(zip(pieces[1::2], match.groups(), strict=True))


def _cjk(text: str) -> bool:
    return any("\u4e00" <= ch <= "\u9fff" for ch in text)


def _alnum(text: str) -> str:
    return "".join(ch for ch in _PLACEHOLDER.sub(" ", text).casefold() if ch.isalnum())


def partial(value: str, scrubbed: str, template: str) -> bool:
    """Whether a piece of ``value`` (four letters or digits in a row, two for Chinese)
    that the record's template text lacks is still in the scrubbed text."""
    norm, left, kept = _alnum(value), _alnum(scrubbed), _alnum(template)
    width = min(len(norm), 2 if _cjk(value) else 4)
    pieces = {norm[i : i + width] for i in range(len(norm) - width + 1)}
    return any(p in left and p not in kept for p in pieces)


def _overlaps(segment: str, value: str) -> bool:
    """Whether a replaced piece of text is (part of) the planted name."""
    seg = segment.strip(" ,.:;!?，。：\n")
    if not seg:
        return False
    if seg in value or value in seg:
        return True
    words = {w for w in re.split(r"\W+", value) if len(w) > 1}
    return bool(words & set(re.split(r"\W+", seg)))


# --- Scores ---------------------------------------------------------------------------


def _cell() -> dict[str, Any]:
    return {"n": 0, "caught": 0, "partial": 0}


def recall(docs: list[Doc], seen: dict[str, Seen], entities: Iterable[str]) -> list[dict[str, Any]]:
    """One row per (entity, kind): per locale, identifiers planted, caught and caught
    only in part; a few missed ones with their context."""
    wanted = set(entities)
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for doc in docs:
        p = doc.planted
        if p is None or p.entity not in wanted:
            continue
        row = rows.setdefault(
            (p.entity, p.kind),
            {"entity": p.entity, "kind": p.kind, "locales": {}, "missed": [], "styles": {}},
        )
        cell = row["locales"].setdefault(doc.locale, _cell())
        result = seen[doc.rid]
        caught = p.value not in result.scrubbed
        cell["n"] += 1
        cell["caught"] += caught
        style = row["styles"].setdefault(p.style or "-", _cell())
        style["n"] += 1
        style["caught"] += caught
        if caught and partial(p.value, result.scrubbed, result.original.replace(p.value, "")):
            cell["partial"] += 1
        if not caught and len(row["missed"]) < 5:
            at = result.scrubbed.find(p.value)
            context = result.scrubbed[max(0, at - 40) : at + len(p.value) + 40]
            row["missed"].append({"locale": doc.locale, "value": p.value, "context": context})
    for (entity, kind), row in rows.items():
        row["target"] = (entity, kind) not in NOT_TARGETS and entity != "name"
        row["note"] = NOT_TARGETS.get((entity, kind), "")
        row["total"] = _total(row["locales"].values())
    order = {e: i for i, (e, _) in enumerate(SHARES)}
    kinds = {k: i for i, k in enumerate((*NAME_CONTEXTS, *CARD_KINDS))}
    return sorted(
        rows.values(), key=lambda r: (order[r["entity"]], kinds.get(r["kind"], 99), r["kind"])
    )


def _total(cells: Iterable[dict[str, Any]]) -> dict[str, Any]:
    total = _cell()
    for cell in cells:
        for key in total:
            total[key] += cell[key]
    total["recall"] = total["caught"] / total["n"] if total["n"] else None
    return total


def name_precision(docs: list[Doc], done: Pass, types: Iterable[str]) -> dict[str, Any]:
    """Of the replacements by name recognizers (``types``), how many replaced (part of)
    a planted name; a few that did not."""
    stems = {deid_entities.PLACEHOLDERS[t] for t in types}
    true = false = unmatched = 0
    wrong: list[str] = []
    for doc in docs:
        result = done.seen[doc.rid]
        found = sum(result.found[t] for t in types)
        if not found:
            continue
        pieces = replaced(result.original, result.scrubbed)
        if pieces is None:
            unmatched += found
            continue
        name = doc.planted.value if doc.planted and doc.planted.entity == "name" else None
        for stem, segment in pieces:
            if stem not in stems:
                continue
            if name is not None and _overlaps(segment, name):
                true += 1
            else:
                false += 1
                if len(wrong) < 10:
                    wrong.append(f"{doc.locale}: {segment!r}")
    findings = true + false
    return {
        "findings": findings,
        "true": true,
        "false": false,
        "unmatched": unmatched,
        "precision": true / findings if findings else None,
        "false_examples": wrong,
    }


def clean_precision(docs: list[Doc], done: Pass, kinds: Iterable[str]) -> dict[str, Any]:
    """How many clean records were changed, by what, and by which kind of clean text."""
    wanted = tuple(kinds)
    clean = [d for d in docs if d.planted is None and d.clean in wanted]
    changed: list[Doc] = [
        d for d in clean if done.seen[d.rid].scrubbed != done.seen[d.rid].original
    ]
    fired: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    seen: Counter[str] = Counter()
    for doc in changed:
        result = done.seen[doc.rid]
        fired.update(result.found)
        by_kind[doc.clean] += 1
        for stem, segment in replaced(result.original, result.scrubbed) or []:
            seen[f"{doc.clean}, {doc.locale}: {segment!r} -> <{stem}>"] += 1
    examples = [f"{what} (x{n})" if n > 1 else what for what, n in seen.most_common(25)]
    return {
        "records": len(clean),
        "changed": len(changed),
        "share": len(changed) / len(clean) if clean else None,
        "fired": dict(fired.most_common()),
        "changed_by_kind": dict(by_kind.most_common()),
        "kinds": {k: sum(d.clean == k for d in clean) for k in wanted},
        "examples": examples,
    }


# --- Which name finders this version has ---------------------------------------------


def name_types() -> tuple[str, ...]:
    """The offline name recognizers' entity types (no dictionary, no model): what the
    ``names`` class word lists besides those, or CONTEXT_NAME, if this version has them."""
    try:
        listed = parse_entities(["names"])
    except ValueError:
        listed = ()
    context = getattr(deid_entities, "CONTEXT_NAME", None)
    found = {t for t in listed if t != deid_entities.DICTIONARY and t not in deid_entities.NER_ONLY}
    if context is not None:
        found.add(context)
    return tuple(t for t in deid_entities.ENTITIES if t in found)


def spacy_pipeline(asked: str) -> tuple[str, str]:
    """The spaCy pipeline for names (c) and a sentence on what is installed."""
    try:
        import spacy
    except ImportError:
        return "", "not installed (no spaCy)"
    installed = sorted(spacy.util.get_installed_models())
    spacy_is = f"spaCy {version('spacy')}"
    if asked:
        return asked, f"{spacy_is}, pipeline {asked}"
    if not installed:
        return "", f"not installed ({spacy_is} is, with no pipeline)"
    pick = next((m for m in installed if m.startswith("xx_")), installed[0])
    return pick, f"{spacy_is}, pipeline {pick}"


def names_result(docs: list[Doc], done: Pass, precision_types: Iterable[str]) -> dict[str, Any]:
    rows = recall(docs, done.seen, ["name"])
    types = tuple(precision_types)
    return {
        "entities": list(done.entities),
        "contexts": rows,
        "total": _total(r["total"] for r in rows),
        "precision": name_precision(docs, done, types) if types else None,
        "seconds": done.seconds,
    }


# --- The run -------------------------------------------------------------------------


def code_version() -> str:
    """The commit of the fedciuic measured, and whether its package has changes not
    committed (several people work in one tree)."""
    import fedciuic

    root = Path(fedciuic.__file__).resolve().parents[1]

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown (not a git checkout)"
    changed = git("status", "--porcelain", "--", "fedciuic")
    return commit + (" with uncommitted changes in fedciuic/" if changed else "")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Generate, write and scrub the corpus in each pass; the result (JSON-ready)."""
    warnings = _Warnings()
    presidio_log = logging.getLogger("presidio-analyzer")
    presidio_log.addHandler(warnings)
    propagates, presidio_log.propagate = presidio_log.propagate, False
    try:
        return _measure(args, warnings)
    finally:
        presidio_log.removeHandler(warnings)
        presidio_log.propagate = propagates


def _measure(args: argparse.Namespace, warnings: _Warnings) -> dict[str, Any]:
    began = time.monotonic()
    docs, names = generate(args.records, args.clean, args.seed)
    direct = parse_entities(["direct"])
    offline = name_types()
    base = tuple(e for e in deid_entities.ENTITIES if e in {*direct, *offline})
    key = b"\x00" * 32  # placeholders: the key is unused
    with tempfile.TemporaryDirectory(prefix="fedciuic-deid-bench-") as tmp:
        root = Path(tmp) / "data"
        size = write(docs, root)
        dictionary_file = Path(tmp) / "customers.txt"
        dictionary_file.write_text("\n".join(sorted(set(names))) + "\n", encoding="utf-8")
        print(f"{len(docs)} records ({size / 1e6:.2f} MB) in {SHAPES}", file=sys.stderr)

        default = scrub_all(root, Scrubber(DeidSpec(base, "placeholder", key)), "default")
        print(f"pass 1 (default region): {default.seconds:.1f}s", file=sys.stderr)
        with_names = tuple(
            e for e in deid_entities.ENTITIES if e in {*base, deid_entities.DICTIONARY}
        )
        customers = load_dictionary(dictionary_file)
        listed = scrub_all(
            root, Scrubber(DeidSpec(with_names, "placeholder", key, customers)), "dictionary"
        )
        print(f"pass 2 (customer list): {listed.seconds:.1f}s", file=sys.stderr)
        pipeline, model_status = spacy_pipeline(args.ner_model)
        model: dict[str, Any] = {"status": model_status}
        if pipeline:
            person = (*base, deid_entities.PERSON)
            spec = DeidSpec(person, "placeholder", key, ner_model=pipeline)
            ner = scrub_all(root, Scrubber(spec), "model")
            model |= names_result(docs, ner, [deid_entities.PERSON])
            print(f"pass 3 (spaCy {pipeline}): {ner.seconds:.1f}s", file=sys.stderr)

    identifiers = sum(d.planted is not None for d in docs)
    return {
        "what": "de-identification recall per entity type and locale, names, clean-text "
        "precision and throughput on Faker-generated records, read and scrubbed as a region does",
        "command": "PYTHONPATH=. .venv/bin/python benchmarks/deidentification.py "
        f"--records {args.records} --clean {args.clean} --seed {args.seed}",
        "settings": {
            "locales": list(LOCALES),
            "records_per_locale": args.records,
            "identifiers": identifiers,
            "clean_records": args.clean,
            "seed": args.seed,
            "shapes": {shape: FILES[shape] for shape in SHAPES},
            "default_entities": list(base),
            "offline_name_types": list(offline),
            "faker": version("faker"),
            "presidio_analyzer": version("presidio-analyzer"),
            "phonenumbers": version("phonenumbers"),
            "recognizers_version": deid_entities.RECOGNIZERS_VERSION,
            "code": code_version(),
            "caught": "the value no longer appears verbatim in its scrubbed record",
        },
        "recall": recall(docs, default.seen, [e for e, _ in SHARES if e != "name"]),
        "names": {
            "dictionary": names_result(docs, listed, ()),
            "offline": names_result(docs, default, offline),
            "model": model,
        },
        "clean": clean_precision(docs, default, NUMBER_KINDS),
        "letters": clean_precision(docs, default, ("letter",)),
        "clean_with_dictionary": clean_precision(docs, listed, CLEAN_KINDS),
        "throughput": {
            "records": len(default.seen),
            "bytes": size,
            "seconds": default.seconds,
            "records_per_s": len(default.seen) / default.seconds,
            "mb_per_s": size / 1e6 / default.seconds,
        },
        "presidio_warnings": warnings.count,
        "seconds": time.monotonic() - began,
    }


# --- Report ---------------------------------------------------------------------------


def _fraction(cell: dict[str, Any] | None) -> str:
    if not cell or not cell["n"]:
        return "—"
    return f"{cell['caught']}/{cell['n']}"


def _recall(total: dict[str, Any]) -> str:
    if not total["n"]:
        return "—"
    return f"{total['recall']:.3f}"


def _recall_table(rows: list[dict[str, Any]], first: str, target: str) -> list[str]:
    head = f"| {first} | " + " | ".join(LOCALES) + " | all | recall | partial | target |"
    lines = [head, "|" + " --- |" * (len(LOCALES) + 5)]
    for row in rows:
        total = row["total"]
        label = row["kind"] if row["entity"] == "name" else f"{row['entity']}: {row['kind']}"
        goal = target if row.get("target", True) else f"reported ({row['note']})"
        if row["entity"] == "name":
            goal = "—"
        cells = [_fraction(row["locales"].get(locale)) for locale in LOCALES]
        lines.append(
            f"| {label} | "
            + " | ".join(cells)
            + f" | {total['caught']}/{total['n']} | {_recall(total)} | {total['partial']} "
            + f"| {goal} |"
        )
    return lines


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    names, clean, speed = result["names"], result["clean"], result["throughput"]
    letters = result["letters"]
    offline = names["offline"]
    lines = [
        "# De-identification benchmark",
        "",
        f"`{result['command']}`: {s['identifiers']:,} identifiers in {len(s['locales'])} "
        f"locales and {s['clean_records']} clean records, Faker {s['faker']} (seed {s['seed']}),"
        f" Presidio {s['presidio_analyzer']}, fedciuic {s['code']} (recognizers "
        f"v{s['recognizers_version']});"
        f" each record written to a {', '.join(s['shapes'].values())} file, read and scrubbed "
        "as a region reads and scrubs it (`read_rows`, `parse_record`, `scrub_record`).",
        "",
        "Caught: the value no longer appears verbatim in its scrubbed record (cells: caught /"
        " planted). Partial: caught, but four letters or digits of it in a row (two for a "
        "Chinese name) are still there.",
        "",
        "| figure | measured | target | verdict |",
        "| --- | --- | --- | --- |",
        *("| " + " | ".join(row) + " |" for row in rows(result)),
        "",
        "## Pattern types (the default region: `direct`"
        + (f" + {', '.join(s['offline_name_types'])}" if s["offline_name_types"] else "")
        + ", no dictionary)",
        "",
        *_recall_table(result["recall"], "entity: kind", f">= {PATTERN_TARGET}"),
        "",
        "## Names",
        "",
        "(a) with the region's customer list (a dictionary of every generated full name; "
        f"entities {', '.join(names['dictionary']['entities'])}): recall "
        f"{_recall(names['dictionary']['total'])}, target >= {NAME_TARGET}.",
        "",
        *_recall_table(names["dictionary"]["contexts"], "context", ""),
        "",
    ]
    if s["offline_name_types"]:
        p = offline["precision"]
        shown = "—" if p["precision"] is None else f"{p['precision']:.3f}"
        lines += [
            f"(b) the offline name recognizers alone ({', '.join(s['offline_name_types'])}, "
            f"no dictionary): recall {_recall(offline['total'])}, precision {shown} "
            f"({p['true']} of {p['findings']} name replacements were a planted name).",
        ]
    else:
        lines += [
            "(b) the offline name recognizers alone: this version has none (no `names` class "
            "word, no CONTEXT_NAME); without a dictionary or a model no name is replaced: "
            f"recall {_recall(offline['total'])}.",
        ]
    lines += ["", *_recall_table(offline["contexts"], "context", ""), ""]
    model = names["model"]
    if "total" in model:
        lines += [f"(c) a NER model ({model['status']}): recall {_recall(model['total'])}.", ""]
        lines += [*_recall_table(model["contexts"], "context", ""), ""]
    else:
        lines += [f"(c) a NER model: {model['status']}.", ""]
    share = clean["share"] or 0.0
    lines += [
        "## Clean text",
        "",
        f"{clean['changed']} of {clean['records']} clean records changed ({share:.1%}; target "
        f"<= {CLEAN_TARGET:.0%}); fired: "
        + (", ".join(f"{k} {v}" for k, v in clean["fired"].items()) or "none")
        + "; by kind of text: "
        + (", ".join(f"{k} {v}" for k, v in clean["changed_by_kind"].items()) or "none")
        + " (of "
        + ", ".join(f"{k} {v}" for k, v in clean["kinds"].items())
        + ").",
        "",
        *(f"- {e}" for e in clean["examples"]),
        "",
        f"Letters with no person in them (greetings to a role, closings signed by a team; "
        f"reported, and counted in the names' precision): {letters['changed']} of "
        f"{letters['records']} changed; fired: "
        + (", ".join(f"{k} {v}" for k, v in letters["fired"].items()) or "none")
        + ".",
        "",
        *(f"- {e}" for e in letters["examples"]),
        "",
        "## Throughput",
        "",
        f"{speed['records']:,} records ({speed['bytes'] / 1e6:.2f} MB) read and scrubbed in "
        f"{speed['seconds']:.1f} s on one core: {speed['records_per_s']:.0f} records/s, "
        f"{speed['mb_per_s']:.2f} MB/s. Presidio warnings logged: {result['presidio_warnings']}.",
        "",
    ]
    return "\n".join(lines)


def rows(result: dict[str, Any]) -> list[Row]:
    """The README's rows: pattern recall, names, clean-text precision, throughput."""
    held = [r for r in result["recall"] if r["target"]]
    worst = min(held, key=lambda r: r["total"]["recall"])
    short = [r for r in held if r["total"]["recall"] < PATTERN_TARGET]
    names = result["names"]
    listed = names["dictionary"]["total"]["recall"]
    offline = names["offline"]
    precision = (offline.get("precision") or {}).get("precision")
    clean, speed = result["clean"], result["throughput"]
    letters = result.get("letters")
    n = result["settings"]["identifiers"]
    return [
        [
            f"de-identification recall, every pattern type ({len(held)} rows: cards by network, "
            f"phones, national IDs, e-mail, IBAN, IP; {n:,} identifiers, 6 locales)",
            f"lowest {worst['total']['recall']:.3f} ({worst['entity']}: {worst['kind']}); "
            f"{len(short)} row(s) below",
            f">= {PATTERN_TARGET} each",
            verdict(not short),
        ],
        [
            "names with the region's customer list (dictionary)",
            f"recall {listed:.3f}",
            f">= {NAME_TARGET}",
            verdict(listed >= NAME_TARGET),
        ],
        [
            "names, offline recognizers alone (no dictionary, no model)",
            f"recall {offline['total']['recall']:.3f}"
            + (f", precision {precision:.3f}" if precision is not None else ""),
            "reported",
            "reported",
        ],
        [
            "clean records changed by de-identification (code, maths, invoices, references, "
            "dates, amounts, versions, tracking numbers)",
            f"{clean['share']:.1%} of {clean['records']}",
            f"<= {CLEAN_TARGET:.0%}",
            verdict(clean["share"] <= CLEAN_TARGET),
        ],
        *(
            [
                [
                    "letters with no person in them changed (greetings to a role, closings "
                    "signed by a team)",
                    f"{letters['share']:.1%} of {letters['records']}",
                    "reported",
                    "reported",
                ]
            ]
            if letters
            else []
        ),
        [
            "de-identification throughput (read + scrub, one core)",
            f"{speed['records_per_s']:.0f} records/s, {speed['mb_per_s']:.2f} MB/s",
            "reported",
            "reported",
        ],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--records", type=int, default=2000, help="identifier records per locale")
    parser.add_argument("--clean", type=int, default=1200, help="clean records in all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ner-model", default="", help="a spaCy pipeline for names (c)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 40 and 48 records")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON (and .md beside it)")
    parser.add_argument("--json", type=Path, help="where run_all.py wants it (as --out)")
    args = parser.parse_args()
    if args.json is not None:
        args.out = args.json
    if args.quick:
        args.records, args.clean = 40, 48
    result = measure(args)
    report = markdown(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(report, encoding="utf-8")
    print(report)
    print(f"{result['seconds']:.0f}s; wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
