"""Names found offline by their context (CONTEXT_NAME): each form caught, only the name
replaced, and the look-alikes of ordinary text kept (fullwidth punctuation written as
escapes, as ruff asks)."""

from __future__ import annotations

import pytest

from fedciuic.deid import DeidSpec, Scrubber, load_dictionary
from fedciuic.deid.names import find_names, may_hold_name

KEY = bytes(range(32))


def names_in(text: str) -> list[str]:
    return sorted({text[s:e] for s, e in find_names(text)})


@pytest.fixture(scope="module")
def scrubber() -> Scrubber:
    return Scrubber(DeidSpec(("EMAIL_ADDRESS", "CONTEXT_NAME"), "placeholder", KEY))


@pytest.mark.parametrize(
    ("text", "names"),
    [
        # after an honorific, in the five languages
        ("Please ask Mr. John Allen about it.", ["John Allen"]),
        ("Mrs Okafor called.", ["Okafor"]),
        ("Ms. Lindqvist and Dr Brennan agreed", ["Brennan", "Lindqvist"]),
        ("Prof. Jean-Pierre O'Brien wrote", ["Jean-Pierre O'Brien"]),
        ("Mr. John van der Berg signed", ["John van der Berg"]),
        ("Sehr geehrter Herr Müller,", ["Müller"]),
        ("Frau Dr. Schäfer ist da", ["Schäfer"]),
        ("M. Dupont et Mme de Villepin", ["Dupont", "de Villepin"]),
        ("Mlle Lefèvre", ["Lefèvre"]),
        ("Sr. García y Sra. Núñez", ["García", "Núñez"]),
        ("Srta. López", ["López"]),
        ("la Sig.ra Rossi e il Sig. Bianchi", ["Bianchi", "Rossi"]),
        ("Dott. Esposito", ["Esposito"]),
        ("D. Juan Pérez García y Don Pedro Sánchez", ["Juan Pérez García", "Pedro Sánchez"]),
        # salutations
        ("Dear Todd Meyer, your order shipped.", ["Todd Meyer"]),
        ("Dear Anna\nthanks for writing", ["Anna"]),
        ("Hi John! How are you?", ["John"]),
        ("hello, Priya: the file is attached", ["Priya"]),
        ("Liebe Jana, danke", ["Jana"]),
        ("Chère Louise,", ["Louise"]),
        ("Hola Marta, ¿qué tal?", ["Marta"]),
        ("Ciao Luca, come stai?", ["Luca"]),
        # signature lines
        ("See you then.\n\nBest regards,\nTodd Meyer\nAccount Manager", ["Todd Meyer"]),
        ("Thanks,\nAmara", ["Amara"]),
        ("Sounds good. Thanks, Bob", ["Bob"]),
        ("Mit freundlichen Grüßen\nJonas Varga", ["Jonas Varga"]),
        ("Cordialement,\nJean-Pierre Dupont", ["Jean-Pierre Dupont"]),
        ("Saludos,\nSofía Castellano", ["Sofía Castellano"]),
        ("Cordiali saluti\nLuca Moretti", ["Luca Moretti"]),
        ("Sincerely,\nHana Tanaka, CFO", ["Hana Tanaka"]),
        ("Mit freundlichen Grüßen\nDipl.-Ing. Jana Ziegert M.Sc.", ["Jana Ziegert"]),
        ("Best regards,\nJohn Smith Jr.", ["John Smith"]),
        # saying one's name (a first name and a surname after "I am")
        ("I am Mei Okafor (mei.okafor@example.org); my order is late", ["Mei Okafor"]),
        ("My name is Anna.", ["Anna"]),
        ("Name: John Smith", ["John Smith"]),
        ("Ich heiße Jana Varga", ["Jana Varga"]),
        ("Sono Marco Rossi", ["Marco Rossi"]),
        # Chinese: a surname and one or two characters in a naming context
        ("王伟先生您好", ["王伟"]),
        ("黎淑珍女士的账户", ["黎淑珍"]),
        ("请联系张经理", ["张"]),
        ("我叫唐荣\uff0c今年三十岁", ["唐荣"]),
        ("客户黎淑珍的账户已冻结", ["黎淑珍"]),
        ("我是王小姐", ["王"]),
        ("姓名\uff1a欧阳娜娜", ["欧阳娜娜"]),
        ("联系人: 司马光", ["司马光"]),
        ("诸葛亮老师", ["诸葛亮"]),
        ("本人梁鑫\uff0c申请开户", ["梁鑫"]),
        ("客户唐荣反映\uff1a卡被锁", ["唐荣"]),  # 反映 follows names: no part of one
        ("亲爱的李娜\uff1a", ["李娜"]),
        ("王伟\uff0c你好\uff01", ["王伟"]),
        ("此致\n敬礼\n黎淑珍", ["黎淑珍"]),
        ("谢谢\uff01\n王磊", ["王磊"]),
        ("请尽快处理\n\u2014\u2014唐荣", ["唐荣"]),
        ("客服专员\uff1a张英", ["张英"]),
        ("Maître Dupont représente la cliente", ["Dupont"]),
        ("我的名字是黎淑珍", ["黎淑珍"]),
        ("在下唐荣", ["唐荣"]),
    ],
)
def test_each_form_finds_the_name_and_only_the_name(text, names):
    assert names_in(text) == names


@pytest.mark.parametrize(
    "kept",
    [
        # ordinary capitalised text
        "The Quick Brown Fox Jumps Over The Lazy Dog.",
        "Python Is Great. Java Is Verbose.",
        "Invoice INV-2019-004512 for March, paid by Bank Transfer.",
        # words after these contexts that name no one: our choices (docs)
        "Dear Sir or Madam,",
        "Dear Customer, your statement is ready.",
        "Dear Valued Customer,",
        "Dear Hiring Manager,",
        "Hi Team, the build is green.",
        "Hello World!",
        "Hello World program in C",
        "Hi there, thanks",
        "Thank you, Mr. President.",
        "She is waiting for Mr. Right.",
        "Dr. Who is a television series.",
        "Sehr geehrte Damen und Herren,",
        "Die Liebe Gottes ist groß.",  # a letter's salutation starts a line or a sentence
        "Mo.\u2013Fr. Geöffnet",
        "Don't Miss Out!",
        "Take vitamin D. Take Care",  # D. is Don only before a first name and a surname
        "Madame la Présidente,",
        "Saludos,\nDepartamento de Atención al Cliente",
        "Mit freundlichen Grüßen\nDie Direktorin",
        "Regards,\nBilling Team",
        "Thanks, Python is great",
        "Regards,\nThe Support Team",
        "Best,\n2024-03-01",
        "I am Canadian",  # one word after "I am": too often no name
        "This is Python code",
        "name: Build and test",  # a YAML key, not a form's field
        "I am Not Sure",
        # lower case is missed, by design: no context can tell
        "dear john, see you",
        # Chinese without a naming context, or a word that starts or ends with a surname
        "王国维护了和平",
        "高级经理负责审批",
        "项目经理和历史老师开会",
        "语文老师和基金经理",
        "许多同学都来了",
        "客户服务中心的电话",
        "我是中国人",
        "我是高中生",
        "各位女士先生",
        "大家好",
        "历史老师您好",
        # an office after a title or a salutation names no one (a class of words)
        "Sehr geehrte Frau Bürgermeisterin,",
        "Gentile Sig. Sindaco,",
        "Monsieur le Maire,",
        "Estimado Sr. Alcalde:",
        "Dear Captain,",
        "Herr Kommissar, bitte",
        "此致\n敬礼\n客户服务部",
    ],
)
def test_ordinary_text_is_kept(kept):
    assert names_in(kept) == []


def test_the_scrubber_replaces_the_name_and_keeps_its_context(scrubber):
    text = "Dear Mr. John Allen,\nyour card is on its way.\n\nRegards,\nTodd Meyer"
    assert scrubber.scrub(text) == (
        "Dear Mr. <NAME>,\nyour card is on its way.\n\nRegards,\n<NAME>"
    )
    chinese = "客户黎淑珍的账户\uff0c请联系王伟先生"
    assert scrubber.scrub(chinese) == "客户<NAME>的账户\uff0c请联系<NAME>先生"


def test_text_without_a_context_is_not_analysed():
    assert not may_hold_name("The Quick Brown Fox, 2024 and all the best of it")
    assert may_hold_name("Regards,\nTodd")
    assert may_hold_name("请联系张经理")


def test_a_name_found_by_context_and_by_the_dictionary_has_one_pseudonym(tmp_path):
    names = tmp_path / "names.txt"
    names.write_text("Todd Meyer\n", encoding="utf-8")
    entities = ("DICTIONARY", "CONTEXT_NAME")
    listed = Scrubber(DeidSpec(entities, "pseudonym", KEY, load_dictionary(names)))
    bare = Scrubber(DeidSpec(entities, "pseudonym", KEY))
    by_dictionary = listed.scrub("Todd Meyer wrote")
    by_context = bare.scrub("Regards,\nTodd Meyer")
    assert by_dictionary.split()[0] == by_context.split("\n")[1]
    assert listed.findings.counts == {"DICTIONARY": 1}  # the dictionary's wins the tie
    assert listed.scrub("Dear Todd Meyer,") == f"Dear {by_dictionary.split()[0]},"
