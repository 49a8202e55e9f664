"""Person names found offline, by the words around them (``CONTEXT_NAME``): no model, no
list of the region's names, so only where the context says a name follows.

Contexts: an honorific, a salutation or greeting, a signature, saying one's name, and for
Chinese a listed surname by a title, greeting, naming word or closing. Only the name is
replaced; lists keep words that are no names (``Dear Sir``, 项目经理). No Presidio, so
that the pipeline's cheap test imports nothing heavy (docs/deidentification.md).
"""

from __future__ import annotations

import re


def _listed(words: str) -> frozenset[str]:
    return frozenset(words.split())


# -- Latin-script names --------------------------------------------------------------------

_EXTENDED_A = [chr(c) for c in range(0x100, 0x180)]
_UPPER = "A-ZÀ-ÖØ-Þ" + "".join(c for c in _EXTENDED_A if c.isupper())
_LOWER = "a-zß-öø-ÿ" + "".join(c for c in _EXTENDED_A if c.islower())
#: One capitalised word of a name: ``Anna``, ``Müller``, ``O'Brien``, ``McDonald``,
#: ``Jean-Pierre``; never a word in capitals (``IT``), never a digit.
_WORD = (
    rf"(?:[{_UPPER}]['\u2019])?[{_UPPER}][{_LOWER}]+(?:[{_UPPER}][{_LOWER}]+)?"
    rf"(?:-[{_UPPER}][{_LOWER}]+)*"
)
_INITIAL = rf"[{_UPPER}]\."
#: The lower-case particles inside names (``van der Berg``, ``de la Cruz``, ``von Trapp``).
_PARTICLE = (
    r"(?:van|von|der|den|de|del|della|delle|dei|degli|di|da|du|des|dos|das|do|le|la|ten|"
    r"ter|zu|zur|y|i|e|bin|ibn|al|el|af|av)"
)
_GAP = r"[ \t]+"
#: Honorifics, case as written (``dr.`` in lower case is rarely a title).
_TITLES = (
    r"Mrs\.?|Mr\.?|Ms\.?|Mx\.?|Miss|Dr\.?|Prof\.?|Professor|Herr|Frau|"
    r"Mme\.?|Mlle\.?|M\.|Madame|Mademoiselle|Monsieur|Sra\.?|Srta\.?|Sr\.|Señora|Señorita|"
    r"Señor|Doña|Dña\.|Dra\.|Sig\.ra|Sig\.na|Sig\.|Signora|Signorina|Signor|Dott\.ssa|"
    r"Dott\.|Dr\.ssa|Prof\.ssa|Avv\.|Ing\.|Maître|Don|Dipl\.-Ing\.|Dipl\.-Kfm\.|Dipl\.-Kffr\.|Mag\."
)
#: Degrees and generations after a name (``Anna Keller M.Sc.``, ``John Smith Jr.``): no
#: part of it, allowed before the end of a greeting or a signature line.
_AFTER_NAME = r"(?:[ \t]+(?:(?:[A-Z][A-Za-z]{0,4}\.){1,3}[A-Za-z]*|MBA|PhD|MD|DDS|CPA|II|III))*"
#: One to four words (and initials and particles) on one line, ended by a title.
_NAME = (
    rf"(?:{_PARTICLE}{_GAP}){{0,2}}(?:{_WORD}|{_INITIAL})"
    rf"(?:{_GAP}(?:{_PARTICLE}{_GAP}){{0,2}}(?!(?:{_TITLES})[ \t])(?:{_WORD}|{_INITIAL})){{0,3}}"
)

_TITLED = rf"(?<![\w.])(?:{_TITLES})(?:{_GAP}(?:{_TITLES})){{0,2}}{_GAP}"
#: A first name and a surname (at least two words).
_FULL_NAME = rf"{_WORD}(?:{_GAP}(?:{_PARTICLE}{_GAP}){{0,2}}(?!(?:{_TITLES})[ \t]){_WORD}){{1,3}}"
#: ``D.`` (Spanish ``Don``) is a title only before a full name (``vitamin D. Take``).
_HONORIFIC = re.compile(rf"{_TITLED}(?P<name>{_NAME})|(?<![\w.])D\.{_GAP}(?P<full>{_FULL_NAME})")

#: A letter's salutations: a name follows (or a title, or ``Sir`` of :data:`_NOT_NAMES`).
_LETTER = (
    r"Dear|Dearest|Liebe|Lieber|Sehr geehrte|Sehr geehrter|Cher|Chère|Chers|Chères|"
    r"Querido|Querida|Estimado|Estimada|Caro|Cara|Carissimo|Carissima|Gentile|"
    r"Gentilissimo|Gentilissima|Egregio|Egregia"
)
#: A chat's greetings: the name must end the greeting (a comma, !, ?, . or the line's end).
_GREETING = (
    r"Hi|Hello|Hey|Hiya|Howdy|Greetings|Good morning|Good afternoon|Good evening|Hallo|"
    r"Moin|Servus|Guten Morgen|Guten Tag|Guten Abend|Bonjour|Bonsoir|Salut|Coucou|Hola|"
    r"Buenos días|Buenas tardes|Buenas noches|Buenas|Ciao|Salve|Buongiorno|Buonasera"
)
_END = rf"(?={_AFTER_NAME}[ \t]*(?:[,!:;.?\r\n]|\Z))"
#: A letter's salutation starts a line or a sentence (``die Liebe Gottes`` is kept).
_SALUTATION = re.compile(
    rf"(?:^|(?<=[.!?:;,]))[ \t]*(?i:{_LETTER}){_GAP}(?:(?:{_TITLES}){_GAP})*(?P<name>{_NAME})",
    re.MULTILINE,
)
_GREETED = re.compile(
    rf"(?<!\w)(?i:{_GREETING})[ \t]*,?{_GAP}(?:(?:{_TITLES}){_GAP})*(?P<name>{_NAME}){_END}"
)

_SIGN_OFF = (
    r"Regards|Best regards|Kind regards|Warm regards|Warmest regards|Best wishes|Best|"
    r"All the best|Thanks|Thank you|Thanks again|Many thanks|Cheers|Sincerely|"
    r"Sincerely yours|Yours sincerely|Yours truly|Yours faithfully|Respectfully|Cordially|"
    r"Love|Take care|Mit freundlichen Grüßen|Freundliche Grüße|Viele Grüße|Beste Grüße|"
    r"Liebe Grüße|Herzliche Grüße|Schöne Grüße|Grüße|Gruß|LG|MfG|VG|Vielen Dank|Danke|"
    r"Cordialement|Bien cordialement|Bien à vous|Salutations|Sincères salutations|"
    r"Amicalement|Bises|Merci|Saludos|Un saludo|Saludos cordiales|Atentamente|Un abrazo|"
    r"Gracias|Cordiali saluti|Distinti saluti|Saluti|Un saluto|Grazie|A presto"
)
#: A sign-off starting its line (or a sentence), then the name: on the next line, or
#: after a comma on the same one; the name ends its line (a comma may follow: a role).
_SIGNATURE = re.compile(
    rf"(?:^[ \t]*|(?<=[.!?])[ \t]+)(?:(?i:{_SIGN_OFF})"
    rf"(?:[ \t]*,[ \t]*(?:\r?\n[ \t]*)?|[ \t]*[!.]?[ \t]*\r?\n[ \t]*)|--[ \t]*\r?\n[ \t]*)"
    rf"(?:(?:{_TITLES}){_GAP})*(?P<name>{_NAME})"
    rf"(?={_AFTER_NAME}[ \t]*[.!]?[ \t]*(?:\r?\n|\Z|,))",
    re.MULTILINE,
)

#: Saying one's name: a name of one word or more follows these (``My name is Anna``).
_NAMED = (
    r"[Mm]y name is|[Cc]all me|[Jj]e m'appelle|[Mm]on nom est|[Ii]ch heiße|"
    r"[Ii]ch heisse|[Mm]ein Name ist|[Mm]e llamo|[Mm]i nombre es|[Mm]i chiamo|"
    r"[Ii]l mio nome è|Full name:|Full Name:|Customer name:|Name:|Nom:|Nombre:|Nome:|"
    r"Vorname:|Nachname:"
)
#: Introducing oneself, where a capitalised word may also be no name (``I am Canadian``,
#: ``This is Python``): only a first name and a surname count (``I am Mei Okafor``).
_INTRODUCED = r"I am|I'm|I\u2019m|[Tt]his is|[Jj]e suis|[Ii]ch bin|[Ss]oy|[Ss]ono"
_SELF = re.compile(
    rf"(?<!\w)(?:(?:{_NAMED})[ \t]*(?P<name>{_NAME})"
    rf"|(?:{_INTRODUCED}){_GAP}(?P<full>{_FULL_NAME}))"
)

#: Capitalised words that follow these contexts without naming a person: pronouns and
#: articles starting a sentence, roles and groups (``Dear Customer``, ``Hi Team``, ``Mr.
#: President``), greetings' objects (``Hello World``), days, and a few set phrases
#: (``Mr. Right``, ``Dr. Who``), in the five languages of the contexts.
_NOT_NAMES = _listed(
    """
    The A An This That These Those It Its He She We They You Your Yours I My Our Their His
    Her Him Us Me There Here Who What When Where Why How Which And But Or Nor If So Then Also
    As At In On Of For To From With By Is Are Was Were Be Been Not No Yes Please Thanks
    Thank All Any Some Each Every Everyone Everybody Anyone Someone Somebody Nobody None
    Again Back Now Today Tomorrow Yesterday Soon Later Morning Afternoon Evening Night Day
    Monday Tuesday Wednesday Thursday Friday Saturday Sunday Weekend
    Sir Sirs Madam Ma'am Gentlemen Ladies Lady Guys Folks Friend Friends Colleague
    Colleagues Team Teams Group Staff Crew Community Family Everyone World Universe Earth
    America Customer Customers Client Clients User Users Member Members Partner Partners
    Valued Hiring Manager Managers Director Directors Committee Board Editor Editors
    Reviewer Reviewers Applicant Applicants Candidate Candidates Sales Support Service
    Services Admin Administrator Owner Owners Recipient Recipients Reader Readers Student
    Students Parent Parents Patient Patients Doctor Doctors Professor President Vice
    Chairman Chairwoman Chair Speaker Secretary Minister Mayor Governor Senator Officer
    Chief Head General Commissioner Justice Judge Engineer Developer Developers Analyst
    Consultant Associate Right Wrong Fix Know Nice Good Great Fine Well Bank Company
    Department Dept Office Account Accounts Holder Subscriber Subscribers Shopper Guest
    Guests Visitor Visitors Sender Attendees Participant Participants Anonymous Unknown
    Damen Herren Kollegen Kolleginnen Kunde Kundin Kunden Doktor Bürgermeister Präsident
    Alle Sie Ihr Ihre Der Die Das Ein Eine Und Mit Vielen Dank Grüße Gruß Freunde Leute
    Mitglieder Nutzer Leserinnen Leser Eltern Kinder Mitarbeiter Mitarbeiterinnen Gäste
    Teilnehmer Teilnehmerinnen Nachbarn Out
    Messieurs Mesdames Cliente Tous Toutes Le La Les Un Une Et Docteur Président Directeur
    Directrice Ami Amie Amis Collègue Collègues Équipe Utilisateur Abonné
    Señor Señora Señores Señoras Clientes Todos Todas El Los Las Una Y Doctora Presidente
    Director Directora Amigo Amiga Amigos Equipo Usuario Usuarios
    Signore Signora Signori Clienti Tutti Il Lo Gli Dottore Dottoressa Direttore Amico
    Amica Amici Collega Colleghi Utente Utenti
    Billing Accounting Finance Marketing Legal Compliance Operations Management
    Administration Reception Helpdesk Desk Care Relations Resources Human Claims
    Complaints Collections Security Fraud Risk Treasury Payments Cards Lending Mortgage
    Mortgages Loans Branch Headquarters Council Chairperson Inc Ltd LLC Corp Corporation
    GmbH AG SA SpA SRL SL Co Jr Sr
    Abteilung Kundenservice Kundendienst Kundenbetreuung Geschäftsführung
    Geschäftsleitung Leitung Vertrieb Buchhaltung Verwaltung Vorstand Vorsitzender
    Vorsitzende Direktor Direktorin Leiter Leiterin Filiale Zentrale Sachbearbeiter
    Sachbearbeiterin Berater Beraterin Service Support
    Direction Département Présidente Comptabilité Agence Conseiller Conseillère
    Responsable Gérant Gérante Clientèle Réclamations
    Departamento Atención Servicio Dirección Gerente Gerencia Administración Contabilidad
    Oficina Sucursal Reclamaciones Presidenta Asesor Asesora
    Ufficio Reclami Servizio Direzione Direttrice Amministrazione Assistenza Sportello
    Responsabile Consulente Presidentessa
    Mayoress Sheriff Captain Colonel Lieutenant Sergeant Commander Admiral Ambassador
    Consul Chancellor Dean Principal Rector Provost Bishop Father Reverend Pastor Rabbi
    Imam Inspector Detective Constable Agent Nurse Coach Lawyer Attorney Counsel Notary
    Bürgermeisterin Präsidentin Doktorin Professorin Ministerin Kanzler Kanzlerin Rektor
    Rektorin Dekan Dekanin Richter Richterin Notar Notarin Anwalt Anwältin Arzt Ärztin
    Pfarrer Pfarrerin Kommissar Kommissarin Botschafter Botschafterin Konsul Chef Chefin
    Abgeordneter Abgeordnete Senator Senatorin Kapitän Oberst Hauptmann Leutnant
    Maire Ministre Professeur Ingénieur Médecin Juge Notaire Avocat Avocate Commissaire
    Curé Abbé Ambassadeur Recteur Doyen Député Députée Sénateur Sénatrice Capitaine Colonel
    Général Maître
    Alcalde Alcaldesa Ministro Ministra Profesor Profesora Ingeniero Ingeniera Médico Médica
    Juez Jueza Notario Notaria Abogado Abogada Comisario Comisaria Embajador Embajadora
    Decano Decana Diputado Diputada Senadora Capitán Coronel Teniente Sargento Padre
    Sindaco Sindaca Ministra Professore Professoressa Ingegnere Medico Giudice Notaio
    Avvocato Avvocata Commissario Ambasciatore Rettore Preside Deputato Deputata Senatore
    Senatrice Capitano Colonnello Tenente Sergente Onorevole
    """
)

# -- Chinese names ------------------------------------------------------------------------

#: Compound surnames (复姓), tried before the single ones.
_COMPOUND_SURNAMES = _listed(
    "欧阳 司马 诸葛 上官 东方 皇甫 尉迟 公孙 慕容 令狐 长孙 宇文 司徒 夏侯 轩辕 端木 独孤 "
    "南宫 西门 呼延 闻人 澹台 公羊 赫连 钟离 宗政 濮阳 太史 申屠 东郭 拓跋 万俟 司空 左丘 "
    "仲孙 单于 淳于 完颜 乐正 鲜于 巫马 公冶 梁丘 漆雕 第五"
)
#: The common single surnames, less those that are chiefly function words or word parts
#: in running text (于, 向, 和, 时, 司, 管, 车, 全, 房, 席, 班, 乐, 区, 项, 海, 南, 吉).
_SURNAMES = (
    "王李张刘陈杨黄赵吴周徐孙马朱胡郭何高林罗郑梁谢宋唐许韩冯邓曹彭曾肖田董袁潘蒋蔡余杜"
    "叶程苏魏吕丁任沈姚卢姜崔钟谭陆汪范金石廖贾夏韦付傅方白邹孟熊秦邱江尹薛闫阎段雷侯龙"
    "史陶黎贺顾毛郝龚邵万钱严覃武戴莫孔汤常温康施文牛樊葛邢安齐易乔伍庞颜倪庄聂章鲁岳翟"
    "殷詹申欧耿关兰焦俞左柳甘祝包宁尚符舒阮柯纪梅童凌毕单季裴霍涂成苗谷盛曲翁冉骆蓝路游"
    "辛靳柴蒙鲍华喻祁蒲滕屈饶解牟艾尤阳穆农卓古缪简连麦褚娄窦戚岑景党宫费卜冷晏卫米柏宗"
)
_HAN = r"[\u4e00-\u9fff]"
_SURNAME = "(?:" + "|".join(sorted(_COMPOUND_SURNAMES)) + f"|[{_SURNAMES}])"
#: Titles after a name or a surname alone (王伟先生, 张经理), and greetings (王伟你好).
_CN_TITLES = "先生|女士|小姐|经理|老师|医生|律师|教授|主任|总监|行长|同学"
_CN_HELLO = "你好|您好"
#: Words before a name, which then needs a given name (我叫唐荣, 客户王伟, 亲爱的李娜).
_CN_SAYS = "我的名字是|我的名字叫|我叫|我是|名叫|叫做|在下|本人|客户|患者|病人|亲爱的|尊敬的"
#: Form fields, a colon after them or not (姓名 and a colon, 联系人).
_CN_FIELDS = (
    "姓名|联系人|收件人|收货人|持卡人|户名|申请人|借款人|投保人|被保险人|负责人|经办人|专员|客服"
)
#: A letter's closing (此致 敬礼, 谢谢) or a dash, a name alone on the line after it.
_CN_SIGN_OFF = "敬礼|此致|谢谢|多谢|祝好|顺祝商祺|顺颂商祺|顺颂时祺"
_CN_MARKERS = f"{_CN_SAYS}|(?:{_CN_FIELDS})[ \t]*[\uff1a:]?[ \t]*"
#: Characters (almost) never in a given name: particles, pronouns, verbs and the nouns of
#: titles, units and places that follow a name in running text.
_NOT_GIVEN = set(
    "的了是在和与及或们个位些这那各每某其此也都就又再很太最已将要想会能该说讲问来去到给"
    "把被让对向从为以由而但因所年号时先女经医律教主总同行姐级目域部门科务司公品产管销售"
    "财客户服组校院局处室厅副代助吗呢吧啊哦呀我你他她它您咱有没不还并且即则之于着过得地"
    "打买卖做用找看听写读走办请联系电话码账卡额钱款费今昨省市县镇村州"
)
_CN_TITLED = re.compile(
    rf"(?P<surname>{_SURNAME})(?P<given>{_HAN}{{0,2}}?)"
    rf"(?={_CN_TITLES}|[\uff0c,]?[ \t]*(?:{_CN_HELLO}))"
)
_CN_MARKED = re.compile(rf"(?:{_CN_MARKERS})(?P<surname>{_SURNAME})(?P<given>{_HAN}{{1,2}})")
_CN_SIGNED = re.compile(
    rf"(?:(?:{_CN_SIGN_OFF})[\uff01!\u3002\uff0c,]?[ \t]*\r?\n|^[ \t]*\u2014{{1,2}})[ \t]*"
    rf"(?P<surname>{_SURNAME})(?P<given>{_HAN}{{1,2}})[ \t]*(?=\r?\n|\Z)",
    re.MULTILINE,
)
#: Words that follow a name (客户唐荣反映): their first character is not the name's.
_CN_AFTER = _listed(
    """
    反映 反馈 表示 投诉 咨询 办理 申请 提出 询问 致电 前来 到店 同意 确认 签字 需要 希望
    认为 觉得 发现 收到 告知 通知 联系 预约 开户 存款 取款 转账 还款 贷款 提交 填写 持有
    名下 女儿 儿子 丈夫 妻子 父亲 母亲 称其 声称 报案 挂失 来电 来访 今天 昨天 明天
    """
)
#: Words starting or ending with a surname's character (高级经理, 历史老师): not names.
_CN_WORDS = _listed(
    """
    高级 高中 高兴 高速 高度 高效 高端 高校 高层 方面 方法 方式 方案 方向 方便 金额 金融 金牌
    金卡 王国 安全 安排 安装 安心 安徽 明天 明白 明年 黄金 黄色 白色 白天 马上 文件 文化 文章
    文字 常常 常见 常用 常规 成功 成为 成本 成员 成绩 成立 成都 江湖 江苏 江西 万一 关于 关系
    关注 关键 关闭 程序 程度 史上 华人 华为 周末 周期 周围 周年 余额 余下 石油 包括 包含 申请
    任何 任务 任意 连接 路上 温度 康复 许多 许久 许可 谢谢 董事 司机 夏天 夏季 杜绝 范围 叶子
    牛奶 毛巾 毛病 孙子 胡说 胡同 何时 何况 何必 郑重 韩国 曾经 付款 付出 付费 段落 严格 严重
    武器 武术 武汉 颜色 欧元 欧洲 左右 左边 祝福 祝贺 宁可 宁愿 宁夏 尚未 符合 舒服 纪念 纪律
    童年 凌晨 毕业 毕竟 单位 单独 季度 季节 蓝色 游戏 辛苦 解决 解释 尤其 阳光 农业 农民 卓越
    古代 简单 简历 连续 甘肃 郑州 温州 常州 徐州 苏州 罗马 熊猫 陆续 焦点 施工 龙头 雷达 钟头
    历史 语文 中文 英文 日文 法文 德文 韩文 论文 课文 天文 人文 主任 基金 千金 其余 账房 车间
    """
)


def _kept_words(name: str, start: int, least: int = 1) -> tuple[int, int] | None:
    """The span of ``name``'s words up to the first that names no one, trailing particles
    and initials dropped; None where fewer than ``least`` name words are left (``M. A.``)."""
    end = start
    words = 0
    for word in re.finditer(r"\S+", name):
        if word.group() in _NOT_NAMES:
            break
        if re.fullmatch(_WORD, word.group()):
            end, words = start + word.end(), words + 1
    return (start, end) if words >= least else None


def _chinese(text: str) -> list[tuple[int, int]]:
    titled = []
    for match in _CN_TITLED.finditer(text):
        start, end = match.start(), match.end()
        # 高级经理, 许多同学 (a word that starts with the surname's character), 历史老师,
        # 基金经理 (one that ends with it): no name.
        left = text[max(0, start - 1) : start + 1]
        if text[start : start + 2] in _CN_WORDS or left in _CN_WORDS:
            continue
        if not any(c in _NOT_GIVEN for c in match.group("given")):
            titled.append((start, end))
    marked = []
    for match in (*_CN_MARKED.finditer(text), *_CN_SIGNED.finditer(text)):
        start, end = match.start("surname"), match.end("given")
        # Two characters of given name unless the second never is one (客户王伟的) or
        # starts a word that follows names (客户唐荣反映).
        given = match.group("given")
        if len(given) == 2 and (given[-1] in _NOT_GIVEN or text[end - 1 : end + 1] in _CN_AFTER):
            given, end = given[:-1], end - 1
        if not given or any(c in _NOT_GIVEN for c in given):
            continue
        if text[start : start + 2] in _CN_WORDS or text[start:end] in _CN_WORDS:
            continue
        if not any(s < end and start < e for s, e in titled):  # 我是王小姐: the title's
            marked.append((start, end))
    return titled + marked


def _last_words(*alternatives: str) -> frozenset[str]:
    """The last word of each context, in lower case (``regards`` of ``Best regards``)."""
    phrases = re.sub(r"\[(\w)\w\]", r"\1", "|".join(alternatives)).split("|")  # [Mm]y: My
    return frozenset(re.findall(r"\w+", phrase)[-1].lower() for phrase in phrases)


#: Each Latin pattern, and its words: it is tried only where one precedes a capital.
_LATIN = (
    (_HONORIFIC, _last_words(_TITLES, "D")),
    (_SALUTATION, _last_words(_LETTER)),
    (_GREETED, _last_words(_GREETING)),
    (_SIGNATURE, _last_words(_SIGN_OFF)),
    (_SELF, _last_words(_NAMED, _INTRODUCED)),
)
_TRIGGERS = frozenset().union(*(triggers for _, triggers in _LATIN))
#: A word, then (looked at, not taken: ``Dear Mr. Smith``) one after it that may start a
#: name; possessive, so that a word that cannot is given up at once.
_BEFORE_CAPITAL = re.compile(
    rf"(?<!\w)(\w++)[,!.:]?+\s++(?:{_PARTICLE}[ \t]++){{0,2}}"
    rf"(?=([{_UPPER}][{_LOWER}'\u2019.][\w'\u2019-]*+))"
)
_WORDS = re.compile(r"\w+")
#: A signature's delimiter line (``-- ``).
_DELIMITER = re.compile(r"^--[ \t]*\r?$", re.MULTILINE)
_CN_HINT = re.compile(  # literals: fast
    f"{_CN_TITLES}|{_CN_HELLO}|{_CN_SAYS}|{_CN_FIELDS}|{_CN_SIGN_OFF}|\u2014"
)


def _latin(text: str) -> list[tuple[int, int]]:
    signed = _DELIMITER.search(text) is not None
    if _TRIGGERS.isdisjoint(_WORDS.findall(text.lower())) and not signed:
        return []  # most texts: none of the contexts' words
    # The contexts' words before a capitalised word that may be a name (``Thank you. The``: no).
    before = {
        word.lower()
        for word, after in _BEFORE_CAPITAL.findall(text)
        if after.rstrip(".") not in _NOT_NAMES
    }
    found = []
    for pattern, triggers in _LATIN:
        if triggers.isdisjoint(before) and not (signed and pattern is _SIGNATURE):
            continue
        for match in pattern.finditer(text):
            # a name, or a full name (after D., I am): two words of it at least
            group = "name" if match.group("name") is not None else "full"
            span = _kept_words(match.group(group), match.start(group), 1 + (group == "full"))
            if span is not None:
                found.append(span)
    return found


def find_names(text: str) -> list[tuple[int, int]]:
    """The spans of the names found in ``text`` by their context (they may overlap)."""
    return _latin(text) + (_chinese(text) if _CN_HINT.search(text) else [])


def may_hold_name(text: str) -> bool:
    """Whether a name is found in ``text`` by its context: cheap, before the whole analysis."""
    return bool(find_names(text))
