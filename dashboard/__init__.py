"""pushkv's critical-path dashboard (``streamlit run dashboard/app.py``); see README.md."""
