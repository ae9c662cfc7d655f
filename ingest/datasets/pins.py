"""Pinned SHA-256 of every file the named data sets fetch, keyed by the file's path in the
``$ACTSTORE_DATA`` layout (see docs/datasets.md).

The hashes were computed from the copies of the public files in the project's shared data folder
(``../shared/data``, whose README names each file's repository and commit), with ``sha256sum``; a
download that does not match its hash is refused.
"""

from __future__ import annotations

SHA256: dict[str, str] = {
    "fewrel/pid2name.json": "eeedd25512a8e4c2bc06b78009836d27de81807bcba6ed929debd5cd713c07ea",
    "fewrel/val_wiki.json": "76bb44c2485b6faed358a3ce040eadafcc8a8835245cd7e6afc1bef672d4a0bf",
    "known_1000/known_1000.json": "0a1c2c9cbeb7a60e4a9ba03c8769ff3d12336213d6561307bc83de23f12782ce",
    "lre_relations/data/bias/characteristic_gender.json":
        "a89e266418179f86891f580f500dd92ce65918b54112daf2912e80d28ed74d0f",
    "lre_relations/data/bias/degree_gender.json":
        "cb4c69f57ff5cddf3466e1dd48b15eaa5209c5935d2a36f1b0cbcb7b422b1cd2",
    "lre_relations/data/bias/name_birthplace.json":
        "b796df239a577a6bf09d6ad6f1b537a72a7b1a483352090a1586a91f7712584e",
    "lre_relations/data/bias/name_gender.json":
        "cfeded39fc091fb548791cf588e9ab0d1613b2ab5f8e72645929b55a4583fcf2",
    "lre_relations/data/bias/name_religion.json":
        "49552370e79d2ea17ce0c3e5335af42506ac09d6924618de96be20201b300aed",
    "lre_relations/data/bias/occupation_age.json":
        "cc06ab94193e2a0c0a4b0a343ae3b234487cb4893e0377078eee90e3d474f276",
    "lre_relations/data/bias/occupation_gender.json":
        "1b5e02c08ebfcd79225f3e89dd43c859c9e7026beaf5cfc1e5135e053eb10a2f",
    "lre_relations/data/commonsense/fruit_inside_color.json":
        "7986138d585ca5abea5b6821f94b749e17adb027db737618fa7ba44ff2b94c61",
    "lre_relations/data/commonsense/fruit_outside_color.json":
        "b0c11dbdd220f670e232db0ff2899ef221d2d91746415696d2a2ce0513ac033a",
    "lre_relations/data/commonsense/object_superclass.json":
        "e594c3288df3059638ae885d83f2934266bb1968932272c027786bf7b3c02678",
    "lre_relations/data/commonsense/substance_phase.json":
        "8b2fcb4a1d1d5619b8bfa6d229c4fc144eed0fcdc12995853a32e4e925f8c5ab",
    "lre_relations/data/commonsense/task_done_by_person.json":
        "5d60985abf904aa01010171ab0eade79a8050ff9cf38b2b003fd531b7c3e4155",
    "lre_relations/data/commonsense/task_done_by_tool.json":
        "846b190fdb6fa0d58bca47dc7756d81e8104d34ad624428b8fae1662a2a8d9f8",
    "lre_relations/data/commonsense/word_sentiment.json":
        "436546dfbd9f308b6d27748359489e3f3e20a845e8913ab2da62ab2fead80487",
    "lre_relations/data/commonsense/work_location.json":
        "2438376757f35fc80e8925070e855c190f42693f04e6305266cdc2b76e9878c1",
    "lre_relations/data/factual/city_in_country.json":
        "5fd8f9e99e6d8567d05cfb4e7c9324ed03b07ba1ebf827614b7b58a811bc11a5",
    "lre_relations/data/factual/company_ceo.json":
        "c75f9b31c872b85601b7163b2c7a8f11c439f2852a876d5a126401d57ea3a81b",
    "lre_relations/data/factual/company_hq.json":
        "22c86cf64b908db86c73b17add31e59fd6022ac74e500840fcad35bd706a8e4e",
    "lre_relations/data/factual/country_capital_city.json":
        "9945d2da1fa1145c1d7e59ac61a25ebee74299c00bd53fc9308167f9e1d44fc0",
    "lre_relations/data/factual/country_currency.json":
        "4a1a49afbdc4792fc330196475f456a22bc49dfe0ec9eb966439e4f36081d99b",
    "lre_relations/data/factual/country_language.json":
        "0996525735107934f0d2e467e6fac7d2c785c42e8300ccb41ae6e9b5dfde2b76",
    "lre_relations/data/factual/country_largest_city.json":
        "ffb5e18dc1f26a101786905db84f087370bb191067ff8d9f1294156b1d9bdccc",
    "lre_relations/data/factual/food_from_country.json":
        "2e308f61974de104eaa29a432bca1232802f9c6e1ea145151f384d96412d4a21",
    "lre_relations/data/factual/landmark_in_country.json":
        "58d545ec481a0d22be5f8ce1f50410093349daf002f3e7c1f8ad26c2c1fde581",
    "lre_relations/data/factual/landmark_on_continent.json":
        "64ec992304e0cc91ac4ada2e7d32d13401e171ea9e09fa65525273842b82160b",
    "lre_relations/data/factual/person_band_lead_singer.json":
        "ad4943c8bc14d649577dafce7acb8d81b2a56ea1f39ca806cdba20880dcd6742",
    "lre_relations/data/factual/person_father.json":
        "796e03665de86d7441b2374fb443c1ddebc77749c01c4bab92c571fda4c8753d",
    "lre_relations/data/factual/person_mother.json":
        "bcf99ade0df1d9d8a03d40149aaf054cc7ecbd7f20ec6afe071d9361d2875d02",
    "lre_relations/data/factual/person_native_language.json":
        "ad6f699fbad04cecf45a424713249803921598187c6302dd2a8e20702f4c1928",
    "lre_relations/data/factual/person_occupation.json":
        "57e89f94c17ff0fd55d5e3ad3aa24ee5e118a3ff7447fff88457113a0e4ce7a7",
    "lre_relations/data/factual/person_plays_instrument.json":
        "e7c92e6a4d35b6198775a6f6062c948ca95aaedf2cc84a009b07989e4ccac08a",
    "lre_relations/data/factual/person_plays_position_in_sport.json":
        "adfc0605d1f31809329171e9ef348ca354b372934d8197e6e20693b0cb9e1c6f",
    "lre_relations/data/factual/person_plays_pro_sport.json":
        "adfea3a51c0315818a63ec0a421fba45818f3854212f9999910c80eac934165c",
    "lre_relations/data/factual/person_university.json":
        "739fc4a11861d30a71852243fc6e06e8d34143b8e0ca3dd65cb9bb3bc5a0190c",
    "lre_relations/data/factual/pokemon_evolutions.json":
        "254e3982935571cfd4311ea774da0d2a4b2a577c6c86e0f74508a9651efc6494",
    "lre_relations/data/factual/presidents_birth_year.json":
        "4b6e7cf48aff48db010a0aa78ab674f0cebeb2d950203d0723a1e7227cb3ad23",
    "lre_relations/data/factual/presidents_election_year.json":
        "16a81b72fd253b82d7571d63e0e5ed3906eb62fde565b31ed2cd81967bfc46ee",
    "lre_relations/data/factual/product_by_company.json":
        "373dac4b5322dc29ca800b8bf38bac78a0d9297e56ee877100733f68e9c3da40",
    "lre_relations/data/factual/star_constellation.json":
        "328aa42c7960f8ce5a75a1fbe766141e0b22473c6a35d8b2e8165a4050188bde",
    "lre_relations/data/factual/superhero_archnemesis.json":
        "bd335092e081782d7e49a4a3472c0aac54b14999a3b78e68f6d94fe7ed7dcb38",
    "lre_relations/data/factual/superhero_person.json":
        "3b3a3a03d4b5c0b91343d4e7d562a434a17ae85ef286ed151bafee65c19a7804",
    "lre_relations/data/linguistic/adj_antonym.json":
        "bcfe2e8ed0cabe0650499a1aa64df908aed94898192efc112a0b082dc49b32dd",
    "lre_relations/data/linguistic/adj_comparative.json":
        "1409f9d0fd887990e016a417ad724dc9714b51ee68638130c7c2897ba7f8bc51",
    "lre_relations/data/linguistic/adj_superlative.json":
        "8d816383390e894a7f7b2c5880a68905c25a2bf376bd7f372496b3a8d2ab47e0",
    "lre_relations/data/linguistic/verb_past_tense.json":
        "7a9e9ad41d90e0ea18c03d62813881af66e96e10a8fc6e884404a05b21bfb5fc",
    "lre_relations/data/linguistic/word_first_letter.json":
        "b084acead4479f7305891074f4b53fc8b21f0ad6d31e44c992b5a72d75f9d467",
    "lre_relations/data/linguistic/word_last_letter.json":
        "a9ffb875a35323fe6151ed132186057c5c060e461aa119dc41ef50dc52fe5068",
    "maps/datasets/adj_antonym/adj_antonym.json":
        "d94c1ec842aa1779320e41b40fb1758176dcf755a3f688e482ace7f538893c77",
    "maps/datasets/adj_comparative/adj_comparative.json":
        "1b23180c1258c367e3d84a6bee0c4da9e3762adb97dde6055a459b5b80974fe0",
    "maps/datasets/adj_superlative/adj_superlative.json":
        "f7625125259fdb8cfec72ed7d9af2829981c83b3323cb2797e915b094b8df9ac",
    "maps/datasets/country_to_capital_wikidata/country_to_capital_wikidata.json":
        "e064acb490935a3142dc4059557c7b42463d9ed025b43202973f7797053bb424",
    "maps/datasets/country_to_official_language_wikidata/country_to_official_language_wikidata.json":
        "32e25a57eabdfcdd93a98d6c3f7a1f6dafd9a819abbbcdc849d08ff25b56047a",
    "maps/datasets/english_to_french/english_to_french.json":
        "e279241226e279759ec6b3c1f4c950e354fd8a943883cb3d566609554b7cb4ae",
    "maps/datasets/english_to_spanish/english_to_spanish.json":
        "098dc0d971e7198878cb14c703b8aaac57e71b8f67c38d2f5c8e9570e9d4fbc1",
    "maps/datasets/entity_to_pronoun/entity_to_pronoun.json":
        "6cbef5a0c3b21122e8b035ffc0793fdb39bbee013ca1ffcbf3878330e5a25572",
    "maps/datasets/general_copying_english_500/general_copying_english_500.json":
        "29367166deaaf3d66d91919b8a072b7d969810dc0e508bca2a1d890afd73042b",
    "maps/datasets/name_copying/name_copying.json":
        "7b6b2409a65e76014478c66fdc1572c48367c1bbb7981155d306131843145f24",
    "maps/datasets/object_superclass/object_superclass.json":
        "be90a66845e2dea8b6c499b047a86191c1005f5f07f336cbf2ca9bf072b78a60",
    "maps/datasets/product_by_company/product_by_company.json":
        "855afe4501838e62df552e44d8e7159071a9a8009decc2188cf8af2d065b198a",
    "maps/datasets/verb_past_tense/verb_past_tense.json":
        "c3d32a5a08ecd25eed0ca962560b0e89ece82e4ff9669acf77c474e74eaa0bd2",
    "maps/datasets/word_first_letter/word_first_letter.json":
        "afae4e1db9391fd414599f2a7f375dae33a47bf6e16ae3ca8554f77ac7b7d600",
    "maps/datasets/word_last_letter/word_last_letter.json":
        "e5d15ccb6a9dc6ba2db91874f5275f90d4b1ff4430a08b20bd97bc17772a0455",
    "maps/datasets/word_to_compound/word_to_compound.json":
        "1a15e8a27c4791a802092f99e081ab8e8e9b0e93d0b2fb04af4265a9ce9fff45",
    "maps/datasets/word_to_homophone/word_to_homophone.json":
        "9ba00923276b6efd427570af8249e15c8854625b81580b51b9dba69740cd4433",
    "maps/datasets/word_to_synonym/word_to_synonym.json":
        "a367367f0167392dd6a604ad73bf4a37bca002396fbe1646b9bc967678bff007",
    "maps/datasets/work_location/work_location.json":
        "aa2b7ee59dc581bb6148abcb44443fe60c76cf48bcb65116e79302e95637e139",
    "maps/datasets/year_to_following/year_to_following.json":
        "014c22918b1867777e2e299212f65fc394ae5b0bb1b6dd614366d6c58b5756a2",
    "codex_m/test.txt": "0575ce05e4ce915e395bb4f708e8df9547989dd4c8c71407cbfd78c19daffcf7",
    "codex_m/train.txt": "d99c3437ab51690391a26d96976adf6e5494dba7ef6902e77000551bfa566556",
    "codex_m/valid.txt": "11c323096367354940846b9ed940c5dabddc1d20a70474222babe7e7fd28b28d",
}
