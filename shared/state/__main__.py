from shared.state.sql import main

main()
